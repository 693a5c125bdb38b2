"""CPU seconds of the intra-op model's Python on seeded random problems of target a's
size (the planner's presolve, then ``build_model``), to compare two trees side by side:

    OMP_NUM_THREADS=1 python benchmarks/in_tree.py /tmp/base benchmarks/linear_build_ab.py
    OMP_NUM_THREADS=1 python benchmarks/linear_build_ab.py

Each problem: 700 nodes of 8-64 strategies (a tenth with one, a tenth of the rest
forbidden), 16 layouts each, 900 edges with a fifth of their pairs impossible and prices
drawn from a few values (ties, so presolve removes strategies); after presolve about 68
thousand columns and 13.6 thousand rows (a third of the 2-D views' columns). Prints per
phase the CPU seconds (``time.process_time``, not the wall) and a digest of the output
(the model's arrays, presolve's reductions), which must be the same for both trees.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np

from torchalpa.passes.sharding.ilp import Edge
from torchalpa.passes.sharding.ilp_model import build_model
from torchalpa.passes.sharding.presolve import presolve


def problem(seed: int):
    rng = np.random.default_rng(seed)
    costs, layout_of = {}, {}
    for n in range(700):
        count = 1 if rng.random() < 0.1 else int(rng.integers(8, 65))
        c = rng.integers(0, 6, count).astype(float)
        if count > 1:
            c[rng.random(count) < 0.1] = np.inf
            c[0] = min(c[0], 5.0)
        costs[f"n{n}"], layout_of[f"n{n}"] = c, rng.integers(0, 16, count)
    names, edges = list(costs), []
    for _ in range(900):
        u, v = (str(x) for x in rng.choice(names, 2, replace=False))
        table = rng.integers(0, 4, (16, 16)).astype(float)
        table[rng.random((16, 16)) < 0.2] = np.inf
        edges.append(Edge(u, v, layout_of[u], layout_of[v], table))
    return costs, edges


def digest(*parts) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
    return h.hexdigest()[:16]


def main() -> None:
    presolve_s = build_s = 0.0
    for seed in range(3):
        costs, edges = problem(seed)
        start = time.process_time()
        reduced = presolve(costs, edges, [])
        presolve_s += time.process_time() - start
        start = time.process_time()
        model = build_model(reduced.costs, reduced.edges, [], reduced, [], None, False, 1.0).model
        build_s += time.process_time() - start
        arrays = (model.names, model.cost, model.upper, model.integer, model.row_lower,
                  model.row_upper, model.starts, model.index, model.value)
        kept = [c.tolist() for c in reduced.costs.values()]
        print(f"seed {seed}: {len(model.names)} columns, {len(model.row_lower)} rows, "
              f"{len(model.index)} nonzeros; presolve {digest(reduced.dominated_by, kept)}, "
              f"model {digest(*arrays)}", flush=True)
    print(f"CPU s: presolve {presolve_s:.2f}, build_model {build_s:.2f}", flush=True)


if __name__ == "__main__":
    main()
