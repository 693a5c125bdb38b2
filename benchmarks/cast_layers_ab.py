"""A mixed-precision pipeline planned with the casts cut in forward's order (main before
r10-scale) and with their readers (``layers.parameter_ops``), in turn in one process.

    python benchmarks/cast_layers_ab.py

The pipeline tests' small GPT (4 blocks, 256 wide, batch 8 x 64) in ``CastForward``
bfloat16, 8 micro-batches of 1, 4 layers, on their small cluster (2 nodes x 2 devices):
``plan_pipeline`` once per layering. Prints each estimate, its stages and the seconds it
took (the VM may be shared: compare the two lines of one run).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

import torchalpa.models as zoo
from torchalpa.frontends.torch_export import capture
from torchalpa.passes.pipeline_search import layers as layering
from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
from torchalpa.runtime.execution.precision import CastForward, MixedPrecision

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from search_models import small_cluster, small_pipeline  # noqa: E402


def main() -> None:
    config = zoo.GPTConfig(vocab_size=512, max_seq_len=64, num_layers=4, num_heads=4,
                           hidden=256, dropout=0.0)
    workload = zoo.Workload("gpt", config, 8, 64)
    with torch.device("meta"):
        model = CastForward(workload.build(), MixedPrecision(param_dtype=torch.bfloat16))
        batch = workload.example_inputs()
    graph = capture(model, tuple(x[:1] for x in batch), workload.loss_fn).graph
    kept = layering.parameter_ops
    try:
        for label, follow in (("casts in forward's order (main)", False),
                              ("casts with their readers (r10-scale)", True)):
            layering.parameter_ops = kept if follow else (lambda graph: set())
            start = time.perf_counter()
            plan = plan_pipeline(graph, small_cluster(), small_pipeline(4))
            print(f"{label}: est {plan.estimates.step_time_s!r} s/step, stages "
                  f"{[(s.layers, s.submesh) for s in plan.stages]}, "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
    finally:
        layering.parameter_ops = kept


if __name__ == "__main__":
    main()
