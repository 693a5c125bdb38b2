"""Target b's first pipeline candidate, phase by phase, planned by two source trees side by
side; and the stage DP alone replayed on the cost tables that search built.

    git -C /work/main archive main | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 python benchmarks/stage_phase_ab.py plan /tmp/base . \\
        [--blocks 40] [--tables DIR]
    OMP_NUM_THREADS=1 python benchmarks/stage_phase_ab.py replay /tmp/base . --tables DIR

``plan``: LLaMA-2-13B (``--blocks`` decoder layers; 40 is the model) on target b's cluster
(50 x 4 devices of 32 GB), 200 micro-batches, remat none, planned by ``plan_pipeline``
with ``workers=1`` (polish_ab.py's ``_one``: AutoParallel's first candidate on b), each
tree in its own process, both started together so that they share the load. Prints per
tree the CPU seconds (``time.process_time``, this process: with one worker it is all the
search's) of the layer ILPs (``LayerCosts.prefetch``), the stage phase
(``StageSearch.run``) split into the stage DP (``stage_dp``) and the exact stage solves
(``StageSearch._price``), and the stages' own plans (``_assemble``); the DP runs, the
bounds they ran the DP for (``num_t_max_tried``), stage ILPs, HiGHS runs, the estimate
and a hash of the plan JSON (``in_tree.plan_text``). ``--tables DIR``: the first tree
also saves every cost table its DP was given (``stages._cost_table``'s array) there.

``replay``: each tree's ``stage_dp`` on every saved table, in one process per tree, one
after the other, three times, alternating: the CPU seconds of each tree's DP runs and
whether every answer (total, t_max, stages with their latencies) is the same.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pickle
import subprocess
import sys
import time

from _clusters import v100_like
from in_tree import import_tree, plan_text


def _timed(owner, name: str, into: dict, key: str):
    """Wrap ``owner.name`` to add its CPU seconds and calls to ``into[key]``."""
    inner = getattr(owner, name)
    into.setdefault(key, [0.0, 0])

    def wrapped(*a, **kw):
        start = time.process_time()
        try:
            return inner(*a, **kw)
        finally:
            into[key][0] += time.process_time() - start
            into[key][1] += 1
    setattr(owner, name, wrapped)
    return inner


def _plan(root: str, blocks: int, tables: str | None) -> dict:
    """Plan b's first candidate with the tree at ``root``; its phases' CPU and counts."""
    os.environ["TORCHALPA_CACHE"] = "0"
    import_tree(root)
    import hashlib

    import torch

    import torchalpa
    import torchalpa.models as zoo
    from torchalpa.core.options import PipeshardParallel
    from torchalpa.frontends.torch_export import capture
    from torchalpa.passes.pipeline_search import inter_op, stage_search, stages
    from torchalpa.passes.pipeline_search.layer_costs import LayerCosts
    from torchalpa.passes.sharding import ilp_highs

    assert torchalpa.__file__.startswith(root), (torchalpa.__file__, root)
    w = zoo.llama2_13b(batch_size=1).replace(num_layers=blocks)
    with torch.device("meta"):
        model, batch = w.build(), w.example_inputs()
    graph = capture(model, batch, w.loss_fn).graph
    cluster = v100_like(torchalpa, 50)
    phases: dict[str, list] = {}
    _timed(LayerCosts, "prefetch", phases, "layer ILPs")
    _timed(stage_search.StageSearch, "run", phases, "stage phase")
    _timed(stage_search.StageSearch, "_price", phases, "exact stage solves")
    _timed(inter_op, "_assemble", phases, "stages' own plans")
    _timed(ilp_highs, "solve_with_highs", phases, "HiGHS runs")
    dp = stage_search.stage_dp
    bounds = [0]

    def counted_dp(*a, **kw):
        start = time.process_time()
        try:
            found = dp(*a, **kw)
            bounds[0] += found.num_t_max_tried
            return found
        finally:
            entry = phases.setdefault("stage DP", [0.0, 0])
            entry[0] += time.process_time() - start
            entry[1] += 1
    stage_search.stage_dp = counted_dp
    if tables:
        table = stages._cost_table

        def saved(*a, **kw):
            C = table(*a, **kw)
            n = len(glob.glob(os.path.join(tables, "*.pkl")))
            with open(os.path.join(tables, f"{n:03d}.pkl"), "wb") as f:
                pickle.dump({"C": C, "args": saved.args}, f)
            return C
        saved.args = None

        def remember(*a, **kw):
            saved.args = a[:4]
            return counted_dp(*a, **kw)
        stages._cost_table = saved
        stage_search.stage_dp = remember
    cpu = time.process_time()
    plan = inter_op.plan_pipeline(graph, cluster, PipeshardParallel(num_micro_batches=200),
                                  workers=1)
    cpu = time.process_time() - cpu
    return {"cpu": cpu, "phases": phases, "bounds run": bounds[0],
            "stage ILPs": plan.estimates.stage_solves, "est": plan.estimates.step_time_s,
            "plan": hashlib.sha256(plan_text(plan).encode()).hexdigest()[:16]}


def _replay(root: str, tables: str) -> dict:
    """``stage_dp`` of the tree at ``root`` on each saved table: CPU and answers."""
    import_tree(root)
    from torchalpa.passes.pipeline_search.stages import stage_dp
    cpu, answers = 0.0, []
    for path in sorted(glob.glob(os.path.join(tables, "*.pkl"))):
        with open(path, "rb") as f:
            saved = pickle.load(f)
        C = saved["C"]
        L, N, M, B = saved["args"]
        start = time.process_time()
        found = stage_dp(L, N, M, B, lambda k, i, j, s, C=C: float(C[k, i, j, s]))
        cpu += time.process_time() - start
        answers.append([found.total, found.t_max, found.num_t_max_tried,
                        [[*st.layers, *st.submesh, st.latency] for st in found.stages]])
    return {"cpu": cpu, "answers": answers}


def _child(mode: str, root: str, args) -> subprocess.Popen:
    extra = ["--blocks", str(args.blocks)] + (["--tables", args.tables] if args.tables else [])
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), mode, "--one",
                             os.path.abspath(root), *extra], stdout=subprocess.PIPE, text=True)


def _last_json(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"a child failed (rc {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])


def _print_plan(tree: str, run: dict) -> None:
    phases = " | ".join(f"{name} {cpu:.1f} s ({calls})"
                        for name, (cpu, calls) in run["phases"].items())
    print(f"{tree}: {run['cpu']:.1f} s CPU | {phases} | {run['bounds run']} bounds run | "
          f"{run['stage ILPs']} stage ILPs | est {run['est']!r} | plan {run['plan']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["plan", "replay"])
    p.add_argument("trees", nargs="*")
    p.add_argument("--blocks", type=int, default=40)
    p.add_argument("--tables")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--one", metavar="ROOT", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        run = _plan(args.one, args.blocks, args.tables) if args.mode == "plan" else \
            _replay(args.one, args.tables)
        print(json.dumps(run))
        return
    if args.mode == "plan":
        if args.tables:
            os.makedirs(args.tables, exist_ok=True)
        first = _child("plan", args.trees[0], args)
        args.tables = None
        procs = [first] + [_child("plan", tree, args) for tree in args.trees[1:]]
        runs = [_last_json(proc) for proc in procs]
        for tree, run in zip(args.trees, runs):
            _print_plan(tree, run)
        print(f"load {os.getloadavg()[0]:.1f}; plans "
              f"{'equal' if len({r['plan'] for r in runs}) == 1 else 'DIFFER'}")
        return
    cpu: dict[str, list[float]] = {tree: [] for tree in args.trees}
    answers = []
    for _ in range(args.rounds):
        for tree in args.trees:
            run = _last_json(_child("replay", tree, args))
            cpu[tree].append(run["cpu"])
            answers.append(run["answers"])
    for tree in args.trees:
        print(f"{tree}: stage DP on {len(answers[0])} tables: "
              + ", ".join(f"{c:.2f}" for c in cpu[tree]) + " s CPU")
    first = min(cpu[args.trees[0]])
    for tree in args.trees[1:]:
        print(f"{tree}: {min(cpu[tree]) / first:.3f}x {args.trees[0]}'s (least of each)")
    same = all(a == answers[0] for a in answers)
    print(f"answers {'equal' if same else 'DIFFER'} (total, t_max, bounds run, stages)")


if __name__ == "__main__":
    main()
