"""Where target a's capture goes: CPU seconds per stage and per piece of the search's flow.

The flow as target a's search ran it (its INFO log of 2026-12-01): LLaMA-3-8B bf16, batch
16 x 8192, meta; the whole batch traced; 4 micro-batches derived and checked by records
of the step's ops; 8 and 2 derived; the ten checkpointing / parameters-gathered-again
variants the search asked for. Each piece (make_fx, the derivation's fake run, each
OpGraph, fx graph copies, the records, the rewrites) is timed with ``time.process_time``
around the function, unprofiled (cProfile's cost per call inflates fx's many small calls);
nested pieces count in both. Prints one JSON line with the stages, the pieces and a hash
of every capture (OpNodes, outputs, meta, generated code and each fx node's value layout),
so two trees' runs show the same captures:

    git archive <commit> | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 python benchmarks/in_tree.py /tmp/base benchmarks/capture_pieces.py 32
    OMP_NUM_THREADS=1 python benchmarks/capture_pieces.py 32 [llama3_70b]
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import time

import torch
import torch.fx as fx

import torchalpa
import torchalpa.frontends.block_remat as block_remat
import torchalpa.frontends.rebatch as rebatch
import torchalpa.frontends.rebatch_check as rebatch_check
import torchalpa.frontends.torch_export as torch_export
import torchalpa.models as zoo
from torchalpa.core.opgraph import OpGraph
from torchalpa.parallel.auto import derived_capture
from torchalpa.parallel.workflow import capture_examples, capture_step, with_precision

VARIANTS = [(1, "full", False), (1, "selective", False), (4, "none", True),
            (4, "full:1", False), (2, "full:2", True), (2, "full:2", False),
            (2, "selective", True), (4, "selective", True), (2, "full:12", True),
            (2, "full:12", False)]
"""(micro-batches, remat, gathered again) of the variants target a's search derived."""

spent: dict[str, float] = {}


def timed(owner, name: str, label: str) -> None:
    """Replace ``owner.name`` by itself adding its CPU seconds to ``spent[label]``."""
    function = getattr(owner, name)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        start = time.process_time()
        try:
            return function(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0.0) + time.process_time() - start
    setattr(owner, name, wrapper)


def _layout(value):
    if isinstance(value, (list, tuple)):
        return tuple(_layout(v) for v in value)
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.storage_offset(), str(value.dtype))
    return repr(value)


def digest(captures) -> str:
    h = hashlib.sha256()
    for c in captures:
        for node in c.graph:
            h.update(repr(node).encode())
        h.update(repr((c.graph.outputs, sorted(c.graph.meta.items()), c.gm.code)).encode())
        for n in c.gm.graph.nodes:
            h.update(repr((n.name, str(n.target), _layout(n.meta.get("val")))).encode())
    return h.hexdigest()[:16]


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    name = sys.argv[2] if len(sys.argv) > 2 else "llama3_8b"
    timed(torch_export, "_trace_joint", "make_fx")
    timed(torch_export, "record_step", "records")
    timed(rebatch, "_rebatched_module", "derivations' fake runs")
    for module in (torch_export, rebatch, block_remat):
        timed(module, "to_opgraph", "OpGraphs")
        timed(module, "find_repeated_blocks", "repeated blocks")
    timed(block_remat, "unchanged_ops", "unchanged_ops")
    timed(block_remat, "checkpoint_graph", "checkpoint_graph")
    timed(block_remat, "rematerialize_graph_views", "regathered views")
    timed(OpGraph, "check", "OpGraph.check")
    timed(fx.Graph, "graph_copy", "fx graph_copy")
    timed(fx.Graph, "eliminate_dead_code", "dead code")
    timed(rebatch_check, "records_vouch", "records_vouch")

    w = zoo.NAMED[name]().replace(num_layers=layers)
    with torch.device("meta"):
        model = with_precision(w.build(), torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    batch = w.example_inputs(device="meta")
    check = rebatch_check.RecordCheck(lambda k: torch_export.record_step(
        model, capture_examples(model, batch, k), w.loss_fn))
    steps = rebatch.MicroBatchSteps(
        lambda k: capture_step(model, capture_examples(model, batch, k), w.loss_fn), check)
    stages: dict[str, float] = {}

    def stage(label: str, make):
        start = time.process_time()
        out = make()
        stages[label] = round(time.process_time() - start, 3)
        return out
    stage("whole batch", lambda: steps(1))
    stage("count 4 derived and checked", lambda: steps(4))
    stage("counts 8 and 2 derived", lambda: (steps(8), steps(2)))
    made = stage("ten variants", lambda: [derived_capture(steps(k), r, g) for k, r, g in VARIANTS])
    print(json.dumps({
        "tree": torchalpa.__file__, "stages": stages, "total": round(sum(stages.values()), 2),
        "pieces": {k: round(v, 3) for k, v in sorted(spent.items(), key=lambda kv: -kv[1])},
        "derived": sorted(steps.derived), "vouched": steps.vouched,
        "hash": digest([steps(1), steps(4), steps(8), steps(2), *made])}))


if __name__ == "__main__":
    main()
