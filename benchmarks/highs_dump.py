"""Run a benchmark script with every intra-op ILP it hands HiGHS saved to a directory: the
corpus ``highs_options_ab.py`` re-solves under other HiGHS options.

    python benchmarks/highs_dump.py /tmp/corpus/a benchmarks/auto_targets.py --targets a

Each run of ``ilp_highs.solve_with_highs`` (the direct path every ``solver='highs'`` ILP
takes) first writes ``<pid>-<n>.npz``: the ``LinearModel``'s arrays, its partial start, and
the ``gap``, ``max_nodes`` and ``time_limit`` it was solved with. Solvers look the function
up on the module at each call and forked workers inherit the wrapper, so the views solved
in AutoParallel's workers are saved too. Opt-in: nothing in ``torchalpa`` writes models.
"""

from __future__ import annotations

import itertools
import os
import runpy
import sys

import numpy as np

from torchalpa.passes.sharding import ilp_highs
from torchalpa.passes.sharding.ilp_model import LinearModel

_count = itertools.count()


def save_model(path: str, model: LinearModel, **limits) -> None:
    """Write ``model`` and its solve's limits (None as NaN) to ``path`` (.npz)."""
    np.savez_compressed(
        path, names=np.asarray(model.names), cost=np.asarray(model.cost, dtype=np.float64),
        upper=np.asarray(model.upper, dtype=np.float64),
        integer=np.asarray(model.integer, dtype=bool),
        row_lower=np.asarray(model.row_lower, dtype=np.float64),
        row_upper=np.asarray(model.row_upper, dtype=np.float64),
        starts=np.asarray(model.starts, dtype=np.int64),
        index=np.asarray(model.index, dtype=np.int64),
        value=np.asarray(model.value, dtype=np.float64),
        initial_cols=np.fromiter(model.initial.keys(), dtype=np.int64),
        initial_vals=np.fromiter(model.initial.values(), dtype=np.float64),
        **{k: np.float64(np.nan if v is None else v) for k, v in limits.items()})


def load_model(path: str) -> tuple[LinearModel, dict[str, float | None]]:
    """The ``LinearModel`` and limits (``gap``, ``max_nodes``, ``time_limit``) saved at
    ``path``."""
    z = np.load(path)
    model = LinearModel(
        names=[str(n) for n in z["names"]], cost=z["cost"].tolist(), upper=z["upper"].tolist(),
        integer=z["integer"].tolist(), row_lower=z["row_lower"].tolist(),
        row_upper=z["row_upper"].tolist(), starts=z["starts"].tolist(),
        index=z["index"].tolist(), value=z["value"].tolist(),
        initial=dict(zip(z["initial_cols"].tolist(), z["initial_vals"].tolist())))
    limits = {k: (None if np.isnan(z[k]) else float(z[k]))
              for k in ("gap", "max_nodes", "time_limit")}
    return model, limits


def install(directory: str) -> None:
    """Save each later ``solve_with_highs`` run's model under ``directory``."""
    os.makedirs(directory, exist_ok=True)
    solve = ilp_highs.solve_with_highs

    def saving(model, *, time_limit, gap, verbose, max_nodes=None):
        if model.names:
            save_model(os.path.join(directory, f"{os.getpid()}-{next(_count)}.npz"), model,
                       gap=gap, max_nodes=max_nodes, time_limit=time_limit)
        return solve(model, time_limit=time_limit, gap=gap, verbose=verbose,
                     max_nodes=max_nodes)

    ilp_highs.solve_with_highs = saving


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    install(sys.argv[1])
    script = sys.argv[2]
    sys.argv = sys.argv[2:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))   # as ``python script`` does
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
