"""HiGHS options weighed on a corpus of the planner's own ILPs: for each saved model (a
directory of ``highs_dump.py``'s .npz files, one class of models per directory) the solve
as the planner runs it, then the same solve with each setting, one after the other in one
process.

    python benchmarks/highs_options_ab.py /tmp/corpus/a /tmp/corpus/tests \\
        --settings base heur0 norins

Per model and setting it prints HiGHS' CPU seconds (``time.process_time`` around
``run``), its simplex iterations and nodes, the objective, and whether the integer columns
chosen are those of the planner's own setting (``same``); at the end, per class and over
the corpus, the sums and each setting's ratio to the planner's. Iterations and nodes are
work, the same at any load; the CPU seconds follow the machine. A setting is safe to adopt
only where every model's columns are the same; its objective must at least stay within
the model's configured gap of the planner's.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time
from typing import NamedTuple

import highspy
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from highs_dump import load_model  # noqa: E402

from torchalpa.passes.sharding import ilp_highs  # noqa: E402

MAIN: dict[str, bool | int | float | str] = {
    name: highspy.Highs().getOptionValue(name)[1] for name in ilp_highs.MIP_OPTIONS}
"""HiGHS' defaults of the options ``ilp_highs.MIP_OPTIONS`` changes: every setting below is
laid over them, so each is weighed against the planner as it ran before those changes."""

SETTINGS: dict[str, dict[str, bool | int | float | str]] = {
    "base": {},
    "tree": {},     # this tree's ``MIP_OPTIONS`` as the planner sets them (see ``_solve``)
    "heur0": {"mip_heuristic_effort": 0.0},
    "heur01": {"mip_heuristic_effort": 0.01},
    "norins": {"mip_heuristic_run_rins": False},
    "norens": {"mip_heuristic_run_rens": False},
    "nosubmip": {"mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False},
    "norootrc": {"mip_heuristic_run_root_reduced_cost": False},
    "nofj": {"mip_heuristic_run_feasibility_jump": False},
    "norestart": {"mip_allow_restart": False},
    "nosym": {"mip_detect_symmetry": False},
    "primal": {"simplex_strategy": 4},
    "pool100": {"mip_pool_soft_limit": 100},
    "nopresolve": {"presolve": "off"},
    "nopre_nofj": {"presolve": "off", "mip_heuristic_run_feasibility_jump": False},
    "nofj_norestart": {"mip_heuristic_run_feasibility_jump": False, "mip_allow_restart": False},
    "nostart": {},      # the planner's model without its partial start (see ``_solve``)
}
"""Named HiGHS option sets, each laid over ``MAIN`` ("base": the planner as it ran before
this tree's ``MIP_OPTIONS``; "tree": as it runs now)."""


HIGHS_GAP = highspy.Highs().getOptionValue("mip_rel_gap")[1]
"""The gap of a run saved without one (HiGHS' default, 1e-4)."""


class Run(NamedTuple):
    cpu: float
    iterations: int
    nodes: int
    objective: float
    status: str
    chosen: np.ndarray


def _solve(path: str, setting: str) -> Run:
    """Solve the model at ``path`` as the planner did, with ``setting`` laid over."""
    model, limits = load_model(path)
    if setting == "nostart":
        model.initial = {}
    max_nodes = None if limits["max_nodes"] is None else int(limits["max_nodes"])
    h, position = ilp_highs.started_highs(model, time_limit=limits["time_limit"],
                                          gap=limits["gap"], verbose=False,
                                          max_nodes=max_nodes,
                                          options={} if setting == "tree" else
                                          {**MAIN, **SETTINGS[setting]})
    start = time.process_time()
    h.run()
    cpu = time.process_time() - start
    info = h.getInfo()
    values = np.asarray(h.getSolution().col_value, dtype=np.float64)
    integer = np.asarray(model.integer, dtype=bool)
    chosen = np.round(values[position][integer]) if values.size == len(model.names) \
        else np.zeros(0)
    return Run(cpu, int(info.simplex_iteration_count), int(info.mip_node_count),
               float(info.objective_function_value), h.getModelStatus().name, chosen)


def same_choice(run: Run, base: Run) -> bool:
    """Whether ``run`` chose every column as ``base`` did (the same plan)."""
    return run.chosen.shape == base.chosen.shape and bool((run.chosen == base.chosen).all())


def _line(name: str, setting: str, run: Run, base: Run, gap: float | None) -> str:
    same = same_choice(run, base)
    rel = abs(run.objective - base.objective) / max(abs(base.objective), 1e-9)
    within = "" if rel <= (HIGHS_GAP if gap is None else gap) + 1e-12 else " OUTSIDE GAP"
    return (f"{name:28s} {setting:10s} cpu {run.cpu:8.2f}  it {run.iterations:7d}  "
            f"nodes {run.nodes:4d}  obj {run.objective:.10g}  {run.status:12s} "
            f"{'same' if same else f'DIFFERENT (rel {rel:.2e})'}{within}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("classes", nargs="+", help="directories of saved models")
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS),
                        choices=list(SETTINGS))
    args = parser.parse_args()
    settings = [s for s in args.settings if s != "base"]
    totals: dict[tuple[str, str], list[float]] = {}
    for directory in args.classes:
        cls = os.path.basename(os.path.normpath(directory))
        for path in sorted(glob.glob(os.path.join(directory, "*.npz"))):
            name = f"{cls}/{os.path.basename(path)[:-4]}"
            gap = load_model(path)[1]["gap"]
            base = _solve(path, "base")
            print(_line(name, "base", base, base, gap), flush=True)
            _add(totals, cls, "base", base, True)
            for setting in settings:
                run = _solve(path, setting)
                print(_line(name, setting, run, base, gap), flush=True)
                _add(totals, cls, setting, run, same_choice(run, base))
    _summary(totals, ["base", *settings])


def _add(totals, cls: str, setting: str, run: Run, same: bool) -> None:
    """Sum ``run`` into its class's and the corpus' totals: cpu, iterations, nodes, models,
    models with different columns."""
    for key in ((cls, setting), ("ALL", setting)):
        t = totals.setdefault(key, [0.0, 0, 0, 0, 0])
        t[0] += run.cpu
        t[1] += run.iterations
        t[2] += run.nodes
        t[3] += 1
        t[4] += 0 if same else 1


def _summary(totals, settings: list[str]) -> None:
    print("\nclass       setting    models  cpu s   (x base)  iterations (x base)  nodes  "
          "different")
    for cls in sorted({c for c, _ in totals}, key=lambda c: (c == "ALL", c)):
        base = totals[(cls, "base")]
        for setting in settings:
            cpu, it, nodes, n, diff = totals[(cls, setting)]
            print(f"{cls:11s} {setting:10s} {n:6d} {cpu:8.1f} ({cpu / base[0]:5.2f})  "
                  f"{it:10d} ({it / max(base[1], 1):5.2f})  {nodes:5d}  {diff}")


if __name__ == "__main__":
    main()
