"""ZeRO-1 and gradients summed in bf16, as plans (on meta, no processes) and as runs on 4
gloo ranks against one device (tests/precision_worker.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import worker_io
from models import MLP
from torch.distributed.tensor import Shard

import torchalpa
from torchalpa.runtime.execution.precision import MixedPrecision

CLUSTER = torchalpa.Cluster(num_nodes=1, devices_per_node=4)


def _plan(method, mixed_precision=None, hidden=256, batch=64):
    with torch.device("meta"):
        model = MLP(hidden, 3)
    x = torch.zeros(batch, hidden, device="meta")
    return torchalpa.plan(model, (x, x), F.mse_loss, method=method, cluster=CLUSTER,
                          mixed_precision=mixed_precision)


def _gradient_bytes(plan) -> dict[str, int]:
    """Bytes of the gradient reductions (all-reduce or reduce-scatter) by kind."""
    out: dict[str, int] = {}
    for c in plan.collectives:
        if c.kind in ("all_reduce", "reduce_scatter") and c.bytes > 4:   # not the loss
            out[c.kind] = out.get(c.kind, 0) + c.bytes
    return out


def test_zero1_all_reduces_gradients_and_shards_the_optimizer_states():
    ddp, zero1, zero2 = (_plan(m()) for m in (torchalpa.DataParallel, torchalpa.Zero1Parallel,
                                                torchalpa.Zero2Parallel))
    grads = 3 * (256 * 256 + 256) * 4
    assert _gradient_bytes(ddp) == {"all_reduce": grads}
    assert _gradient_bytes(zero1) == {"all_reduce": grads}          # whole, as DDP
    assert _gradient_bytes(zero2) == {"reduce_scatter": grads}
    gathered = sum(c.bytes for c in zero1.collectives if c.kind == "all_gather")
    assert gathered == grads // 4                                    # the updated shards
    assert all(p.placements == (Shard(0),) for p in zero1.parameters)
    # Adam's two states and the master parameters split over 4: 3 x 3/4 of the bytes saved
    saved = ddp.estimates.memory_per_device_bytes - zero1.estimates.memory_per_device_bytes
    assert saved >= 0.7 * 3 * grads * 3 / 4, saved
    # an all-reduce moves twice a reduce-scatter's bytes: ZeRO-1 pays for it
    assert zero1.estimates.communication_s > zero2.estimates.communication_s


def test_reduce_dtype_bf16_sums_every_gradient_in_bf16():
    """With 4 micro-batches the planner rightly sums float32 gradients once, after the
    cast up; asked to reduce in bf16, it sums each micro-batch's bf16 gradient."""
    method = torchalpa.DataParallel(num_micro_batches=4)
    free = _plan(method, MixedPrecision(param_dtype=torch.bfloat16))
    narrow = _plan(method, MixedPrecision(param_dtype=torch.bfloat16,
                                          reduce_dtype=torch.bfloat16))
    grads = 3 * (256 * 256 + 256)
    assert _gradient_bytes(free) == {"all_reduce": grads * 4}
    assert _gradient_bytes(narrow) == {"all_reduce": grads * 2}
    assert narrow.method["mixed_precision"] == "bfloat16"


def test_reduce_dtype_must_be_float32_or_the_compute_dtype():
    with pytest.raises(ValueError, match="reduce_dtype must be torch.float32 or the param_dtype"):
        MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    return worker_io.launch_checked(
        "precision_worker.py", tmp_path_factory.mktemp("prec") / "r.json",
        "zero1:fp32,bf16_reduce:dp,bf16_reduce:zero1,bf16_params:zero1,bf16_remat:zero1",
        nproc=4)


def test_zero1_trains_like_one_device(four):
    r = four["zero1:fp32"]
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert got == pytest.approx(want, rel=1e-5)
    assert r["max_param_diff"] < 1e-5 + 1e-5 * r["max_param"]
    assert r["executed"] == r["planned"]
    assert set(r["kinds"]) == {"all_reduce", "all_gather"}
    # each rank holds a quarter of Adam's states
    assert r["state_numel"] * 4 == r["param_numel"] * 2


@pytest.mark.parametrize("method", ["dp", "zero1"])
def test_gradients_summed_in_bf16_train_like_one_device_within_bf16(four, method):
    r = four[f"bf16_reduce:{method}"]
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert got == pytest.approx(want, rel=2e-2)
    # bf16's 8 bits of mantissa, against the largest gradient (a bias gradient summed from
    # partial sums that nearly cancel has a larger error relative to itself)
    assert max(r["grad_diff_to_scale"]) < 3e-2
    assert r["max_param_diff"] < 2e-3 * r["max_param"]   # float32 masters
    assert r["executed"] == r["planned"]
    assert r["param_dtypes"] == ["torch.float32"]
    # every gradient reduction moved bf16: 2 bytes an element
    assert r["reduced_bytes"] == r["grad_numel"] * 2


def test_bf16_parameters_train_like_one_device_within_bf16(four):
    r = four["bf16_params:zero1"]
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert got == pytest.approx(want, rel=2e-2)
    # the first step from equal weights; after it, weights may differ by their last bit
    assert r["grad_diff_to_scale"][0] < 3e-2
    assert max(r["grad_diff_to_scale"]) < 6e-2
    assert r["max_param_diff"] < 1e-2 * r["max_param"]
    assert r["param_dtypes"] == ["torch.bfloat16"]
    assert r["executed"] == r["planned"]


def test_recompute_reads_the_weight_casts_forward_made_once_per_step():
    """ZeRO-1, bf16 casts per block, full recomputation, 4 micro-batches: the recomputed
    forward reads the casts forward made (the parameters do not change within a step), so
    a step gathers each float32 parameter once and nothing in backward; recomputing the
    casts gathered their bf16 copies again with every micro-batch."""
    from precision_worker import block_remat_zero1

    import torchalpa.models as zoo
    from torchalpa.runtime.measurement.issued import issued_collectives
    gpt = zoo.tiny("gpt", batch_size=16, dropout=0.0, num_layers=2)
    with torch.device("meta"):
        method, model = block_remat_zero1(gpt.build())
        batch = gpt.example_inputs()
    plan = torchalpa.plan(model, batch, gpt.loss_fn, method=method, cluster=CLUSTER)
    assert plan.method["remat"] == "full"
    numel = sum(p.numel() for p in model.parameters())
    gathers = [c for c in issued_collectives(plan, 4) if c.kind == "all_gather"]
    assert sum(c.bytes for c in gathers) == numel * 4 // 4     # float32, a quarter each
    assert all(c.phase == "forward" for c in gathers), [c.tensor for c in gathers]


def test_recompute_keeps_weight_casts_only_when_asked():
    """Held casts are asked for where parameters are sharded (ZeRO-1/2); with whole
    parameters each micro-batch in flight would hold its own copy, so the recompute casts
    again (one cheap kernel, no gather)."""
    from precision_worker import block_remat_zero1

    import torchalpa.models as zoo
    from torchalpa.frontends.block_remat import checkpointed_capture
    from torchalpa.frontends.torch_export import capture
    gpt = zoo.tiny("gpt", batch_size=16, dropout=0.0, num_layers=2)
    with torch.device("meta"):
        _, model = block_remat_zero1(gpt.build())
        batch = gpt.example_inputs()
    plain = capture(model, batch, gpt.loss_fn)
    # FSDP / ZeRO-3: backward reads the parameters through views of its own (gathered
    # again there); forward's casts are not held for it even when asked
    regathered = capture(model, batch, gpt.loss_fn, rematerialize_parameters=True)

    def recomputed_casts(keep: bool, captured=plain) -> int:
        graph = checkpointed_capture(captured, "full", keep_parameter_values=keep).graph
        return sum(1 for n in graph.ops() if n.phase == "backward" and
                   n.op == "aten._to_copy.default" and
                   all(graph.node(r.node).kind == "param" for r in n.operands))

    assert recomputed_casts(False) >= 2 * 6          # two blocks' weights and biases
    assert recomputed_casts(True) == 0
    assert recomputed_casts(True, regathered) >= 2 * 6


def test_recompute_with_weight_casts_trains_like_one_device_within_bf16(four):
    r = four["bf16_remat:zero1"]
    assert r["remat"] == "full"
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert got == pytest.approx(want, rel=2e-2)
    assert r["max_param_diff"] < 2e-3 * r["max_param"]   # float32 masters
    assert r["executed"] == r["planned"]
    # each float32 parameter gathered once a step (this rank's quarter of it), not its
    # bf16 cast again in every micro-batch's recompute
    assert r["gathered_bytes"] == [r["param_numel"]] * 3
