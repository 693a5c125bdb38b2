"""Human-readable views of a Plan: ``summary()`` and ``explain(name)``."""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections import Counter

from torchalpa.core.choice_notes import CHOSEN, TRIED, is_choice_note, parse_tried
from torchalpa.core.collective_math import sent_per_rank
from torchalpa.core.placement import long_form, short
from torchalpa.core.plan import OutputSlot, register_view
from torchalpa.core.units import format_bytes
from torchalpa.views.fold import fold, op_label, template

__all__ = ["plan_summary", "explain", "format_bytes", "NameNotInPlan", "wire_bytes",
           "tensor_labels", "DETAILS", "rollup_by_module", "choice_table", "explain_choice"]


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip(), fmt.format(*["-" * w for w in widths])] + \
        [fmt.format(*[str(c) for c in r]).rstrip() for r in rows]


DETAILS = ("short", "full")
_TOP = 10
_TOP_MODULES = 8


@register_view("summary")
def plan_summary(plan, *, detail: str = "short", filter: str | None = None) -> str:
    """The plan on one screen (``detail="short"``: repeated layers folded, communication
    rolled up by module, the ten costliest collectives) or every row (``"full"``).
    ``filter``: a glob over parameter names and collective module paths
    (``"layers.0.*"``, ``"*mlp*"``)."""
    if detail not in DETAILS:
        raise ValueError(f"detail must be one of {DETAILS}, got {detail!r}")
    params = [p for p in plan.parameters if _selected(p.name, filter)]
    collectives = [c for c in plan.collectives if _selected(c.source or "<top>", filter)]
    lines = _header(plan)
    lines.append("")
    lines += _parameter_lines(params, detail, filter)
    if plan.inputs:
        lines.append("")
        lines.append("inputs:")
        rows = [[p.name, "x".join(map(str, p.shape)), short(p.placements)] for p in plan.inputs]
        lines += ["  " + r for r in _table(rows, ["name", "shape", "placement"])]
    lines.append("")
    lines += _collective_lines(plan, collectives, detail)
    if plan.unsupported_ops:
        lines.append("")
        lines.append("ops without a sharding rule (run replicated):")
        for u in plan.unsupported_ops:
            lines.append(f"  {u['op']}  node {u['node']}"
                         + (f"  module {u['module']}" if u.get("module") else "")
                         + (f"  at {u['stack']}" if u.get("stack") else ""))
    lines += _note_lines(plan.notes, detail)
    if detail == "short":
        lines.append("(summary(detail='full') lists every parameter and collective; "
                     "filter='layers.0.*' narrows it)")
    return "\n".join(lines)


def _selected(name: str, pattern: str | None) -> bool:
    return pattern is None or fnmatch.fnmatchcase(name, pattern)


def _header(plan) -> list[str]:
    est = plan.estimates
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.axis_names, plan.mesh_shape))
    lines = [f"torchalpa plan  mesh [{mesh}] ({plan.num_devices} devices)  "
             f"method {plan.method.get('name', '?')}"]
    if est:
        lines.append(
            f"estimated step {(est.step_time_s or 0) * 1e3:.4g} ms "
            f"(compute {(est.compute_s or 0) * 1e3:.4g}, communication "
            f"{(est.communication_s or 0) * 1e3:.4g}); " + memory_line(est))
    return lines


def memory_line(est) -> str:
    """Device memory per device against its budget, its parts, and apart from it the host
    memory offloaded states take: device and host bytes never summed together. A peak
    above the budget is said so (the search rejects such plans; a plan made otherwise, or
    read from a file, may carry one)."""
    budget, peak = est.memory_budget_per_device_bytes, est.memory_per_device_bytes or 0
    parts = [f"states {format_bytes(est.model_state_bytes_per_device or 0)}",
             f"activations {format_bytes(est.activation_bytes_per_device or 0)}"]
    if est.streamed_bytes_per_device:
        parts.append(f"offloaded parameters' copies in flight "
                     f"{format_bytes(est.streamed_bytes_per_device)}")
    text = f"memory per device {format_bytes(peak)}" + \
        (f" of {format_bytes(budget)}" if budget else "") + f" ({', '.join(parts)})"
    if budget and peak > budget * (1 + 1e-9):
        text += f", {format_bytes(peak - budget)} OVER the device budget"
    if est.host_bytes_per_node:
        text += f"; host memory per node {format_bytes(est.host_bytes_per_node)} (offloaded)"
    return text


def _parameter_lines(params, detail: str, filter: str | None) -> list[str]:
    shown = f" matching {filter!r}" if filter else ""
    if detail == "full":
        rows = [[p.name, "x".join(map(str, p.shape)), short(p.placements)] for p in params]
        return [f"parameters{shown}: {len(params)}"] + \
            ["  " + r for r in _table(rows, ["name", "shape", "placement"])]
    folded = fold((p.name, ("x".join(map(str, p.shape)), short(p.placements))) for p in params)
    rows = [[name, shape, layout, f"x{n}" if n > 1 else ""]
            for name, (shape, layout), n in folded]
    head = f"parameters{shown}: {len(params)}"
    if len(folded) < len(params):
        head += f" ({len(folded)} rows, repeated layers folded)"
    return [head] + ["  " + r for r in _table(rows, ["name", "shape", "placement", "count"])]


def wire_bytes(plan, c) -> float:
    """Bytes one rank sends for collective ``c``: the ring algorithm's
    (``core/collective_math.py``, what the cost model prices), on the running process
    group's backend (gloo sends a reduce-scatter as an all-reduce), else NCCL's."""
    n = plan.mesh_shape[c.axis] if c.axis is not None and c.axis < len(plan.mesh_shape) else 2
    return sent_per_rank(c.kind, n, c.bytes, running_backend())


def running_backend() -> str:
    """The initialized process group's backend ("gloo", "nccl"), else "nccl"."""
    import sys
    dist = sys.modules.get("torch.distributed")      # not loaded: no process group either
    if dist is not None and dist.is_available() and dist.is_initialized():
        return str(dist.get_backend())
    return "nccl"


def tensor_labels(plan) -> dict[str, str]:
    """Graph node -> what a person calls it: ``grad layers.3.mlp.up_proj.weight``, a
    parameter or input name; nodes not here are shown as their op (``permute``)."""
    labels = {v.node: v.name for v in tuple(plan.parameters) + tuple(plan.inputs)}
    for r in plan.reshards:
        if isinstance(r.slot, OutputSlot) and r.slot.kind == "grad":
            labels.setdefault(r.producer, "grad " + r.slot.name)
    return labels


def _kind(c) -> str:
    return c.kind + (f"({c.reduce_op})" if c.reduce_op not in (None, "sum") else "")


def _collective_lines(plan, collectives, detail: str) -> list[str]:
    total = sum(c.bytes for c in collectives)
    wire = sum(wire_bytes(plan, c) for c in collectives)
    lines = [f"collectives per step: {len(collectives)} ({format_bytes(total)} contributed, "
             f"{format_bytes(wire)} sent per rank)"]
    if not collectives:
        return lines
    labels = tensor_labels(plan)

    def axis(c):
        return plan.axis_names[c.axis] if c.axis is not None else "-"

    def label(c):
        return labels.get(c.tensor) or op_label(c.tensor)

    if detail == "full":
        # every row: a value without a name keeps its graph node's, which explain() takes
        rows = [[c.phase, _kind(c), axis(c), format_bytes(c.bytes), c.source or "<top>",
                 c.stack or "-", labels.get(c.tensor, c.tensor)] for c in collectives]
        lines += ["  " + r for r in _table(rows, ["phase", "kind", "axis", "bytes", "source",
                                                  "at", "tensor"])]
    else:
        lines += _by_module(plan, collectives, wire)
        lines.append(f"  costliest {_TOP} (bytes sent per rank; identical layers folded):")
        groups: dict = {}
        for c in collectives:
            tmpl, idx = template(c.source or "<top>")
            key = (tmpl, template(label(c))[0], c.phase, _kind(c), axis(c), c.bytes, c.stack)
            groups.setdefault(key, []).append((c, idx))
        ranked = sorted(groups.items(), key=lambda kv: -sum(wire_bytes(plan, c) for c, _ in kv[1]))
        rows = []
        for (_tmpl, _, phase, kind, ax, nbytes, at), members in ranked[:_TOP]:
            source = fold((c.source or "<top>", 0) for c, _ in members)[0][0]
            tensor = fold((label(c), 0) for c, _ in members)[0][0]
            if tensor.startswith(f"grad {source}."):       # the module is in its own column
                tensor = "grad " + tensor[len(f"grad {source}."):]
            rows.append([phase, kind, ax, format_bytes(nbytes),
                         f"x{len(members)}" if len(members) > 1 else "",
                         format_bytes(sum(wire_bytes(plan, c) for c, _ in members)),
                         source, at or "-", tensor])
        lines += ["    " + r for r in _table(rows, ["phase", "kind", "axis", "bytes", "count",
                                                    "sent", "module", "at", "tensor"])]
    counts = Counter((c.phase, c.kind) for c in collectives)
    phases = dict.fromkeys(phase for phase, _ in sorted(counts, key=lambda k: k[0] != "forward"))
    lines.append("  totals: " + "; ".join(
        phase + " " + ", ".join(f"{kind} x{n}" for (p, kind), n in sorted(counts.items())
                                if p == phase) for phase in phases))
    return lines


def rollup_by_module(plan, collectives) -> list[tuple[float, str, tuple, int, list]]:
    """Collectives grouped by folded module, costliest first: rows of (bytes sent per
    rank, folded module name, ((kind, count per module), ...), modules, collectives)."""
    by: dict[str, list] = {}
    for c in collectives:
        by.setdefault(c.source or "<top>", []).append(c)
    groups: dict[tuple, list[tuple[str, list]]] = {}
    for src, cs in by.items():
        kinds = tuple(sorted(Counter(_kind(c) for c in cs).items()))
        groups.setdefault((template(src)[0], kinds), []).append((src, cs))
    rows = []
    for (_, kinds), modules in groups.items():
        members = [c for _, cs in modules for c in cs]
        name = fold((src, 0) for src, _ in modules)[0][0]
        rows.append((sum(wire_bytes(plan, c) for c in members), name, kinds, len(modules),
                     members))
    return sorted(rows, key=lambda r: -r[0])


def _by_module(plan, collectives, wire_total: float) -> list[str]:
    """Communication rolled up by (folded) module, costliest first."""
    rows = rollup_by_module(plan, collectives)
    out = [f"  by module ({len(rows)} rows, costliest first):"]
    table = [[name + (f"  x{n}" if n > 1 else ""), str(len(members)),
              ", ".join(k + (f" x{v}" if v > 1 else "") for k, v in kinds), format_bytes(sent),
              f"{100 * sent / wire_total:.0f}%" if wire_total else "-"]
             for sent, name, kinds, n, members in rows[:_TOP_MODULES]]
    out += ["    " + r for r in _table(table, ["module", "collectives", "kinds (per module)",
                                              "sent", "share"])]
    if len(rows) > _TOP_MODULES:
        rest = rows[_TOP_MODULES:]
        out.append(f"    ... {len(rest)} more modules, {format_bytes(sum(r[0] for r in rest))} "
                   "sent")
    return out


class NameNotInPlan(KeyError):
    """``explain`` of a name the plan does not have; the message suggests close ones."""

    def __init__(self, name: str, known: list[str]):
        close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else \
            f"; it has {len(known)} names, e.g. {', '.join(known[:4])} (plan.summary() lists them)"
        super().__init__(f"{name!r} is neither a parameter, an input nor an op of this plan"
                         + hint)

    def __str__(self) -> str:      # KeyError would print the message quoted
        return self.args[0]


def _names(plan) -> list[str]:
    params = [p.name for p in tuple(plan.parameters) + tuple(plan.inputs)]
    return params + [s.node for s in plan.strategies]


DECISIONS = ("checkpointing", "offload")
"""Names ``explain`` takes besides parameters and ops: the plan's step-wide choices."""


def explain_decision(plan, name: str) -> str:
    """``explain("checkpointing")`` / ``explain("offload")``: what the plan chose and the
    notes that say why (what the search tried, what it costs)."""
    if name == "checkpointing":
        head = f"checkpointing: remat={plan.method.get('remat', 'none')}"
        words = ("checkpointing", "remat=")
    else:
        est = plan.estimates
        on = plan.method.get("offload") or \
            (plan.method.get("auto_sharding_option") or {}).get("offload")
        params = plan.method.get("offload_parameters") or \
            (plan.method.get("auto_sharding_option") or {}).get("offload_parameters")
        what = "parameters, gradients and optimizer states" if params else "optimizer states"
        head = f"offload: {what} in host memory" + (
            f", {est.offload_s * 1e3:.4g} ms per step, "
            f"{format_bytes(est.host_bytes_per_node)} of host memory per node"
            if on and est.offload_s is not None else "") if on else \
            "offload: none (optimizer states on the devices)"
        words = ("offload",)
    return "\n".join([head] + ["  " + n.strip() for n in plan.notes
                               if any(w in n for w in words)])


@register_view("explain")
def explain(plan, name: str) -> str:
    """Where a parameter, input or op lives, and the collectives that move it; or, for
    "checkpointing" and "offload", what the plan chose (``explain_decision``)."""
    if name in DECISIONS:
        return explain_decision(plan, name)
    value = next((p for p in plan.parameters + plan.inputs if p.name == name or p.node == name), None)
    if value is not None:
        node = value.node
        head = f"{value.name}: shape {list(value.shape)}, placement {short(value.placements)} " \
               f"({', '.join(long_form(p) for p in value.placements)})"
    else:
        try:
            strategy = plan.strategy(name)
        except KeyError:
            raise NameNotInPlan(name, _names(plan)) from None
        node = name
        head = f"op {name}: strategy {strategy}"
    moves = [c for c in plan.collectives if c.tensor == node]
    if value is not None:
        grad_sources = {r.producer for r in plan.reshards
                        if r.slot == OutputSlot.grad(value.name)}
        moves += [c for c in plan.collectives if c.tensor in grad_sources and c.phase == "backward"]
    lines = [head]
    why = plan.explanations.get(value.name) if value is not None else None
    if why:
        lines.append(f"  it causes {why.chosen.communication_s * 1e3:.4g} ms of communication "
                     f"per step (its readers and its gradient) and holds "
                     f"{format_bytes(why.chosen.state_bytes)} of state per device")
        other = why.runner_up
        if other:
            lines.append(f"  runner-up {' '.join(other.placements)}: "
                         f"{other.communication_s * 1e3:.4g} ms, "
                         f"{format_bytes(other.state_bytes)} (every other decision unchanged)")
    if moves:
        lines.append("collectives moving it (or its gradient):")
        lines += [f"  {c.phase} {c.kind} on {plan.axis_names[c.axis]}: {format_bytes(c.bytes)}"
                  for c in moves]
    else:
        lines.append("no collective moves it or its gradient")
    return "\n".join(lines)


@register_view("pipeline_summary")
def pipeline_summary(plan, detail: str = "short") -> str:
    est = plan.estimates
    lines = [f"torchalpa pipeline plan  cluster {plan.mesh_shape[0]} node(s) x "
             f"{plan.mesh_shape[1]} devices  {len(plan.stages)} stages  "
             f"{plan.num_micro_batches} micro-batches  schedule {plan.schedule}"]
    if est.step_time_s is not None:
        source = " from stage times measured on the devices" \
            if est.stage_times == "measured" else ""
        lines.append(f"estimated step {est.step_time_s * 1e3:.3f} ms "
                     f"(slowest stage {(est.max_stage_s or 0) * 1e3:.3f} ms per micro-batch)"
                     + source)
    lines += _pipeline_memory(plan)
    lines.append(f"forward_stage_layer_ids = {plan.forward_stage_layer_ids}")
    lines.append(f"submesh_shapes = {[list(s) for s in plan.submesh_shapes]}")
    lines.append(f"logical_mesh_shapes = {[list(s) for s in plan.logical_shapes]}")
    lines.append(f"stage_options = {plan.stage_options}")
    lines.append("")
    rows = []
    stage_seconds = est.stage_step_s or [(s.plan.estimates.step_time_s or 0)
                                                 for s in plan.stages]
    peaks = stage_peaks(plan)
    for s in plan.stages:
        e = s.plan.estimates
        rows.append([str(s.index), f"{s.layers[0]}-{s.layers[-1]}", "x".join(map(str, s.submesh)),
                     "x".join(map(str, s.plan.mesh_shape)), str(list(s.ranks)),
                     f"{stage_seconds[s.index] * 1e3:.3f}",
                     format_bytes(e.model_state_bytes_per_device or 0),
                     format_bytes(peaks[s.index]),
                     str(len(s.plan.collectives)), "recompute" if s.recompute else "keep"])
    lines += _table(rows, ["stage", "layers", "submesh", "logical", "ranks", "ms/micro-batch",
                           "states", "memory/device", "collectives", "activations"])
    lines += _stage_checkpointing(plan)
    if plan.transfers:
        lines.append("")
        each = [t for t in plan.transfers if not t.once_per_step]
        lines.append(f"transfers per micro-batch: {len(each)} "
                     f"({format_bytes(sum(t.bytes for t in each))}); once per step: "
                     f"{len(plan.transfers) - len(each)} "
                     f"({format_bytes(sum(t.bytes for t in plan.transfers if t.once_per_step))})")
        for t in plan.transfers:
            lines.append(f"  {t.phase:<8} stage {t.src_stage} -> {t.dst_stage}  "
                         f"{format_bytes(t.bytes):>10}  {t.producer}"
                         + (("  (parameter: once per step)" if t.phase == "forward" else
                             "  (summed over micro-batches: once per step)")
                            if t.once_per_step else ""))
    timeline = est.timeline
    if timeline:
        lines.append("")
        lines.append("estimated timeline (F/B = forward/backward of a micro-batch):")
        lines += _gantt(timeline, (est.step_time_s or 0))
    lines += _note_lines(plan.notes, detail)
    return "\n".join(lines)


def stage_peaks(plan) -> list[float]:
    """Each stage's peak bytes per device over the whole pipelined step: the micro-batches
    it holds at once in its schedule, or its optimizer step (the pipeline's
    ``stage_memory_bytes``); a stage plan's own peak is one micro-batch's, used only where
    the pipeline's figures are not recorded."""
    recorded = plan.estimates.stage_memory_bytes
    if recorded and len(recorded) == len(plan.stages):
        return [float(b) for b in recorded]
    return [float(s.plan.estimates.memory_per_device_bytes or 0) for s in plan.stages]


def _pipeline_memory(plan) -> list[str]:
    """The device peak -- the fullest stage's, in its schedule -- against the budget, with
    that stage's model states (each stage's are in the table below). The peak, the
    pipeline's ``memory_per_device_bytes``, is the largest of ``stage_peaks``."""
    peaks = stage_peaks(plan)
    if not peaks:
        return []
    top = max(range(len(peaks)), key=peaks.__getitem__)
    budget = plan.estimates.memory_budget_per_device_bytes or \
        plan.stages[top].plan.estimates.memory_budget_per_device_bytes
    states = plan.stages[top].plan.estimates.model_state_bytes_per_device or 0
    text = (f"memory per device {format_bytes(peaks[top])}"
            + (f" of {format_bytes(budget)}" if budget else "")
            + f" (the fullest stage, {top}: states {format_bytes(states)}, "
              f"{format_bytes(max(peaks[top] - states, 0.0))} more at its peak in the schedule")
    text += ")" if not budget or peaks[top] <= budget * (1 + 1e-9) else \
        f"), {format_bytes(peaks[top] - budget)} OVER the device budget"
    return [text]


def _stage_checkpointing(plan) -> list[str]:
    """Where a plan checkpoints the first k blocks (remat "full:k"), which of them each
    stage holds: the blocks named by its parameters (``layers.3.*`` is block 3)."""
    policy, _, count = str(plan.method.get("remat", "")).partition(":")
    if not count.isdigit():
        return []
    k, parts = int(count), []
    for s in plan.stages:
        blocks = sorted({int(m.group(1)) for p in s.plan.parameters
                         if (m := re.search(r"(?:^|\.)(\d+)\.", p.name))})
        done = [b for b in blocks if b < k]
        parts.append(f"stage {s.index} " + (f"blocks {done[0]}-{done[-1]} ({policy})"
                                            if done else "none"))
    return [f"checkpointing per stage: {'; '.join(parts)}"]


def _gantt(timeline, total, width: int = 64) -> list[str]:
    out = []
    scale = width / total if total else 0
    for s, actions in enumerate(timeline):
        row = [" "] * width
        for kind, m, start, end in actions:
            a, b = int(start * scale), max(int(start * scale) + 1, int(end * scale))
            for x in range(a, min(b, width)):
                row[x] = kind if kind == "F" else "b"
            label = str(m % 10)
            if a < width:
                row[a] = label
        out.append(f"  stage {s} |" + "".join(row) + "|")
    return out


@register_view("pipeline_explain")
def pipeline_explain(plan, name: str) -> str:
    """``explain(name)`` of the stage holding ``name``, with the stage and its ranks."""
    if name in DECISIONS:
        return explain_decision(plan, name)
    for s in plan.stages:
        if any(p.name == name for p in s.plan.parameters) or \
                any(st.node == name for st in s.plan.strategies):
            return f"stage {s.index} (ranks {list(s.ranks)}):\n" + explain(s.plan, name)
    raise NameNotInPlan(name, [n for s in plan.stages for n in _names(s.plan)])


def _note_lines(notes, detail: str) -> list[str]:
    """The plan's notes; ``detail="short"``: AutoParallel's choice as one table of candidate
    families (``choice_table``) in place of a line per candidate tried."""
    if detail == "full":
        return [f"note: {n}" for n in notes]
    return [f"note: {n}" for n in notes if not is_choice_note(n)] + choice_table(notes)


def choice_table(notes) -> list[str]:
    """AutoParallel's decision in a few lines: the choice, then per candidate family (kind
    and checkpointing mode) how many were tried, the best estimate or why none was planned
    (the most frequent reason). Empty for a plan of another method."""
    chosen = next((n for n in notes if n.startswith(CHOSEN)), None)
    if chosen is None:
        return []
    tried = [t for n in notes if n.startswith(TRIED)
             if (t := parse_tried(n[len(TRIED):])) is not None]
    best = parse_tried(chosen[len(CHOSEN):])
    families: dict[str, list] = {}
    for t in ([best] if best is not None else []) + tried:
        families.setdefault(t.family, []).append(t)
    rows = []
    for family, members in families.items():
        planned = [t.step_s for t in members if t.step_s is not None]
        if planned:
            why = f"est {min(planned):.4g} s/step" + \
                (" (chosen)" if best is not None and family == best.family else "")
        else:
            why = Counter(t.outcome for t in members).most_common(1)[0][0]
        rows.append([family, str(len(members)), why])
    lines = [chosen, "candidates (families; plan.explain_choice() lists each of the "
             f"{len(tried) + 1} tried):"]
    return lines + ["  " + r for r in _table(rows, ["family", "tried", "best, or why none"])]


@register_view("explain_choice")
def explain_choice(plan) -> str:
    """AutoParallel's choice, the runner-up and every candidate tried, one line each."""
    lines = [n for n in plan.notes if is_choice_note(n)]
    return "\n".join(lines) if lines else \
        "this plan was not chosen by AutoParallel (its method is " \
        f"{plan.method.get('name', 'given')}): no candidates were tried"
