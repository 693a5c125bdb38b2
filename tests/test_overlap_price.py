"""passes/pricing/overlap_price.py: the step's time with communication overlapped as the runtime
issues it on GPUs, and the causal share of attention's blocks (passes/pricing/attention_price.py)."""

from __future__ import annotations

import pytest

from torchalpa.passes.pricing.attention_price import causal_share
from torchalpa.passes.pricing.overlap_price import (
    FIRST_BUCKET_BYTES,
    CommEvent,
    overlapped_step,
    program_order,
)

FWD, BWD = "forward", "backward"


def test_serial_collectives_add_to_the_compute():
    events = [CommEvent(2.0, 1, 0, "serial", kind="all_reduce")]
    whole, micro = overlapped_step([1.0, 1.0, 1.0], [FWD] * 3, events, 0.0)
    assert whole == micro == pytest.approx(5.0)


def test_a_prefetched_gather_runs_behind_the_previous_parameters_compute():
    # gathers of 1 s for the readers at ops 0, 1, 2 (3 s of compute each): the first is
    # exposed, each next one runs while the previous reader computes
    events = [CommEvent(1.0, i, 0, "gather", kind="all_gather") for i in range(3)]
    whole, _ = overlapped_step([3.0, 3.0, 3.0], [FWD] * 3, events, 0.0)
    assert whole == pytest.approx(1.0 + 9.0)
    # a gather longer than the compute it hides behind shows its excess
    events = [CommEvent(5.0, i, 0, "gather", kind="all_gather") for i in range(3)]
    assert overlapped_step([3.0] * 3, [FWD] * 3, events, 0.0)[0] == pytest.approx(
        5.0 + 5.0 + 5.0 + 3.0)


def test_backward_s_first_gather_is_not_prefetched_from_forward():
    events = [CommEvent(1.0, 0, 0, "gather", phase=FWD, kind="all_gather"),
              CommEvent(1.0, 1, 0, "gather", phase=BWD, kind="all_gather")]
    order = program_order(["mm", "mm"], [FWD, BWD], events, 0.0)
    assert order == ["issue all_gather", "wait all_gather", "mm", "backward",
                     "issue all_gather", "wait all_gather", "mm"]


def test_gradient_buckets_go_out_during_backward_and_the_last_one_is_exposed():
    mib = FIRST_BUCKET_BYTES
    # backward of 4 ops of 1 s; each makes a gradient of 1 MiB reduced in 0.5 s
    grads = [CommEvent(0.5, i, 0, "gradient", mib, BWD, "all_reduce") for i in range(4)]
    whole, micro = overlapped_step([1.0] * 4, [BWD] * 4, grads, 25 * mib)
    assert micro == pytest.approx(4.0)
    # first bucket (1 MiB) after op 0 hides behind ops 1-3; the other three gradients
    # make one 25 MiB bucket, issued after op 3: 1.5 s exposed
    assert whole == pytest.approx(4.0 + 1.5)
    order = program_order([None] * 4, [BWD] * 4, grads, 25 * mib)
    assert order == ["issue all_reduce", "issue all_reduce", "wait all_reduce",
                     "wait all_reduce"]


def test_each_mesh_axis_has_its_own_stream():
    events = [CommEvent(2.0, 0, 0, "gather", kind="all_gather"),
              CommEvent(2.0, 0, 1, "gather", kind="all_gather")]
    assert overlapped_step([1.0], [FWD], events, 0.0)[0] == pytest.approx(3.0)


def test_cast_gathers_of_zero3_are_priced_as_prefetched():
    """Mixed precision: ZeRO-3 gathers each parameter's bfloat16 copy (cast, then
    gathered). The runtime prefetches those as it does a parameter's own gathers
    (runtime/rewrites/overlap.py), so on GPUs the estimate hides them behind the previous
    layer's compute: more is hidden than the gradients' reductions alone."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    import torchalpa
    with torch.device("meta"):
        layers = []
        for _ in range(4):
            layers += [nn.Linear(4096, 4096, bias=False), nn.ReLU()]
        model = nn.Sequential(*layers[:-1])
        x, y = torch.randn(64, 4096), torch.randn(64, 4096)
    plan = torchalpa.plan(model, (x, y), F.mse_loss, method=torchalpa.Zero3Parallel(),
                          cluster=torchalpa.Cluster.preset("h100", 1, 4),
                          mixed_precision=torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    gathered = [c.tensor for c in plan.collectives if c.kind == "all_gather"]
    assert gathered and all(t.startswith("_to_copy") for t in gathered)   # cast gathers
    e = plan.estimates
    assert e.hidden_communication_s is not None and e.hidden_gradient_s is not None
    assert e.hidden_communication_s - e.hidden_gradient_s > 0.1 * e.communication_s


@pytest.mark.parametrize("length, share", [(128, 1.0), (256, 0.75), (2048, 17 / 32),
                                           (8192, 65 / 128)])
def test_causal_attention_computes_the_blocks_on_and_below_the_diagonal(length, share):
    assert causal_share(length, length) == pytest.approx(share)
