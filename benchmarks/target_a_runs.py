"""Target a's search with every view solve and every HiGHS run logged, in the workers too:

    OMP_NUM_THREADS=1 TORCHALPA_CACHE=0 python benchmarks/target_a_runs.py /tmp/a [--tree ROOT]

Plans target a as ``auto_targets.py --targets a`` does (LLaMA-3-8B bf16, batch 16 x 8192,
1 x 8 H100, AutoParallel defaults), ``import torchalpa`` reading the tree at ``ROOT`` if
given (``in_tree.import_tree``; default this checkout). Appends one JSON line per HiGHS run
(the view, the candidate's node count, micro-batches and regathering, the gap, the start's
columns, CPU seconds, HiGHS' node count, status and columns) and one per finished view
solve (its CPU seconds) to ``OUT.runs.jsonl`` -- forked workers append to the same file --
and writes ``OUT.json`` (wall and CPU seconds with the workers', estimate, plan hash) and
``OUT.plan.json`` (``in_tree.plan_text``) when a plan is found.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import time

from in_tree import import_tree, plan_text


def _logged(out: str):
    """Wrap HiGHS and ``plan_intra_op`` so each run and view solve appends a line to ``out``."""
    from torchalpa.passes.sharding import ilp_highs, intra_op
    solve, read, plan_intra_op = ilp_highs.solve_with_highs, ilp_highs._read, \
        intra_op.plan_intra_op
    view: dict = {}
    info: dict = {}

    def write(record: dict) -> None:
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")

    def read_info(h):
        i = h.getInfo()
        info.update(mip_nodes=int(i.mip_node_count), status=h.getModelStatus().name,
                    columns=int(h.getNumCol()))
        return read(h)

    def run(model, **kwargs):
        info.clear()
        cpu = time.process_time()
        try:
            return solve(model, **kwargs)
        finally:
            write(dict(pid=os.getpid(), cpu=time.process_time() - cpu, gap=kwargs.get("gap"),
                       start=len(model.initial or {}), **view, **info))

    def planned(graph, mesh, method=None, **kwargs):
        option = getattr(method, "auto_sharding_option", None)
        view.update(mesh="x".join(map(str, mesh.shape)), graph_nodes=len(graph),
                    micro_batches=getattr(method, "num_micro_batches", None),
                    regather=getattr(option, "rematerialize_parameters", None))
        cpu = time.process_time()
        try:
            return plan_intra_op(graph, mesh, method, **kwargs)
        finally:
            write(dict(view_done=True, pid=os.getpid(), cpu=time.process_time() - cpu, **view))

    ilp_highs.solve_with_highs, ilp_highs._read = run, read_info
    intra_op.plan_intra_op = planned


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="path prefix of the files written")
    p.add_argument("--tree", help="the source tree to import torchalpa from")
    args = p.parse_args()
    os.environ.setdefault("TORCHALPA_CACHE", "0")
    if args.tree:
        import_tree(args.tree)
    import torch

    import torchalpa
    import torchalpa.models as zoo
    open(args.out + ".runs.jsonl", "w").close()
    _logged(args.out + ".runs.jsonl")
    w = zoo.llama3_8b()
    with torch.device("meta"):
        model = w.build()
    batch = w.example_inputs(device="meta")
    cpu, wall = time.process_time(), time.perf_counter()
    plan = torchalpa.plan(model, batch, w.loss_fn, cluster=torchalpa.Cluster.h100(1, 8),
                          mixed_precision=torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    wall = time.perf_counter() - wall
    workers = resource.getrusage(resource.RUSAGE_CHILDREN)
    text = plan_text(plan)
    with open(args.out + ".plan.json", "w") as f:
        f.write(text)
    result = dict(tree=torchalpa.__file__, wall=wall,
                  cpu=time.process_time() - cpu + workers.ru_utime + workers.ru_stime,
                  est=plan.estimates.step_time_s, mesh=list(plan.mesh_shape),
                  plan=hashlib.sha256(text.encode()).hexdigest()[:16],
                  load=os.getloadavg()[0])
    with open(args.out + ".json", "w") as f:
        json.dump(result, f)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
