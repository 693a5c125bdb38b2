"""Pipeline schedules as data: for each stage, the order of its forward and backward work.

``("F", m)`` runs micro-batch m's forward on the stage, ``("B", m)`` its backward. A stage
sends each forward's activations to later stages and each backward's gradients to
earlier ones, so a schedule is valid when every action's inputs were produced by an
earlier action of the stage that makes them (``check_schedule``) -- then blocking
point-to-point transfers cannot deadlock.

* GPipe: every forward, then every backward (in reverse micro-batch order). Holds all B
  micro-batches' activations.
* 1F1B: stage ``s`` of ``S`` first runs ``S - s - 1`` warm-up forwards, then alternates one
  forward and one backward, then drains the remaining backwards. Holds at most
  ``S - s`` micro-batches' activations.
"""

from __future__ import annotations

__all__ = ["gpipe", "one_f_one_b", "SCHEDULES", "check_schedule", "in_flight", "simulate"]

Action = tuple[str, int]


def gpipe(num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    B = num_micro_batches
    return [[("F", m) for m in range(B)] + [("B", m) for m in reversed(range(B))]
            for _ in range(num_stages)]


def one_f_one_b(num_stages: int, num_micro_batches: int) -> list[list[Action]]:
    B = num_micro_batches
    out = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, B)
        actions: list[Action] = [("F", m) for m in range(warmup)]
        f, b = warmup, 0
        while f < B:
            actions.append(("F", f))
            f += 1
            actions.append(("B", b))
            b += 1
        actions += [("B", m) for m in range(b, B)]
        out.append(actions)
    return out


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def in_flight(actions: list[Action]) -> int:
    """Most micro-batches whose forward ran and backward has not (activations held)."""
    live = peak = 0
    for kind, _ in actions:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def check_schedule(schedule: list[list[Action]], num_micro_batches: int) -> None:
    """Raise if the schedule cannot run: an action waits on one that never comes first.

    Runs it through ``simulate`` at no cost: an action runs when the data it needs exists
    (F m on stage s needs F m of s-1; B m needs F m here and B m of s+1).
    """
    S = len(schedule)
    for s, actions in enumerate(schedule):
        want = sorted(actions)
        full = sorted([("F", m) for m in range(num_micro_batches)] +
                      [("B", m) for m in range(num_micro_batches)])
        if want != full:
            raise ValueError(f"stage {s} does not run each forward and backward exactly once")
    simulate(schedule, [0.0] * S, [0.0] * S)


def simulate(schedule: list[list[Action]], forward_s: list[float], backward_s: list[float],
             send_s: list[float] | None = None) -> list[list[tuple[str, int, float, float]]]:
    """Start and end time of every action, each stage running its list in order and
    waiting for its inputs (``send_s[s]``: time to move stage s's output to s+1)."""
    S = len(schedule)
    send_s = send_s or [0.0] * S
    end: dict[tuple[int, str, int], float] = {}
    out: list[list] = [[] for _ in range(S)]
    pos = [0] * S
    clock = [0.0] * S
    while any(pos[s] < len(schedule[s]) for s in range(S)):
        progressed = False
        for s in range(S):
            if pos[s] == len(schedule[s]):
                continue
            kind, m = schedule[s][pos[s]]
            if kind == "F":
                deps = [] if s == 0 else [(s - 1, "F", m)]
                extra = send_s[s - 1] if s > 0 else 0.0
            else:
                deps = [(s, "F", m)] + ([] if s == S - 1 else [(s + 1, "B", m)])
                extra = send_s[s] if s < S - 1 else 0.0
            if all(d in end for d in deps):
                start = max([clock[s]] + [end[d] + (extra if d[0] != s else 0.0) for d in deps])
                t = forward_s[s] if kind == "F" else backward_s[s]
                end[(s, kind, m)] = clock[s] = start + t
                out[s].append((kind, m, start, start + t))
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: schedule[s][pos[s]] for s in range(S) if pos[s] < len(schedule[s])}
            raise ValueError(f"the schedule deadlocks: stages wait on {stuck}")
    return out
