"""``AutoShardingOption(elementwise="fused")`` prices a torch graph's elementwise chains as
``torch.compile`` / XLA run them (``passes/pricing/fused_pricing.py``): a value made by a pointwise
op and read only by pointwise ops and reductions moves no bytes; flops stay."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import torchalpa
from torchalpa.core.cluster import Cluster
from torchalpa.core.options import AutoShardingOption, ShardParallel
from torchalpa.parallel.workflow import capture_step
from torchalpa.passes.pricing.fused_pricing import is_elementwise, is_reduction, priced_as


class RMSNormMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(64))
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x):
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return self.proj(F.silu(normed))


@functools.lru_cache(maxsize=1)
def _capture():
    torch.manual_seed(0)
    return capture_step(RMSNormMLP(), (torch.randn(32, 64), torch.randn(32, 64)),
                        F.mse_loss).graph


def test_torch_tags_sort_aten_ops():
    assert is_elementwise("aten.pow.Tensor_Scalar") and is_elementwise("aten.silu.default")
    assert is_elementwise("aten.mul.Tensor") and not is_elementwise("aten.mm.default")
    assert is_reduction("aten.mean.dim") and is_reduction("aten._softmax.default")
    assert not is_elementwise("torchalpa.sdpa.default") and not is_reduction("aten.bogus")


def test_fused_chains_move_fewer_bytes_with_the_same_flops():
    graph = _capture()
    assert priced_as(graph, "eager") is graph
    fused = priced_as(graph, "fused")
    assert [n.name for n in fused] == [n.name for n in graph]
    assert [n.flops for n in fused] == [n.flops for n in graph]
    eager_bytes = {n.name: n.bytes for n in graph}
    # the pow -> mean -> add -> rsqrt -> mul chain: pow's result is never written
    power = next(n for n in fused if n.op == "aten.pow.Tensor_Scalar")
    assert power.bytes == eager_bytes[power.name] - power.output.nbytes
    assert sum(n.bytes for n in fused) < 0.8 * sum(eager_bytes.values())
    for n in fused:
        if n.op in ("aten.mm.default", "aten.addmm.default"):
            assert n.bytes == eager_bytes[n.name]     # matmuls read and write everything
    with pytest.raises(ValueError, match="elementwise"):
        priced_as(graph, "compiled")
    with pytest.raises(ValueError, match="elementwise"):
        AutoShardingOption(elementwise="compiled")


def test_the_planner_prices_the_fused_step_cheaper():
    torch.manual_seed(0)
    mesh = Cluster.local_cpu(2).logical_mesh((2,))
    batch = (torch.randn(32, 64), torch.randn(32, 64))

    def plan(mode):
        method = ShardParallel(auto_sharding_option=AutoShardingOption(elementwise=mode))
        return torchalpa.plan(RMSNormMLP(), batch, F.mse_loss, cluster=mesh, method=method)
    eager, fused = plan("eager"), plan("fused")
    assert fused.estimates.compute_s < eager.estimates.compute_s


class Bf16Head(torch.nn.Module):
    """A bf16 head whose logits the loss reads in float32 (a GPT's head under autocast)."""

    def __init__(self, vocab: int = 4096):
        super().__init__()
        self.head = torch.nn.Linear(64, vocab, bias=False, dtype=torch.bfloat16)

    def forward(self, x):
        return self.head(x.to(torch.bfloat16)).float()


def _peak(graph, fused: bool | None) -> float:
    from torchalpa.passes.pricing.memory import liveness
    live = liveness(graph, fused=fused)
    sizes = [sum(o.nbytes for i, o in enumerate(graph.node(v).outputs) if k in (None, i))
             for v, k in live.entries()]
    return float(live.total(sizes).max())


def test_a_compiled_cross_entropy_holds_the_bf16_logits_not_three_float32_copies():
    # eager PyTorch holds the float32 copy's log-softmax into backward, then the one-hot
    # gradient and its scaled copy beside it: three float32 logit tensors at once.
    # Compiled, the cast, log-softmax, one-hot and softmax backward fuse into the loss's
    # kernels: the bf16 logits are kept for backward and one bf16 gradient is made.
    torch.manual_seed(0)
    rows, vocab = 256, 4096
    graph = capture_step(Bf16Head(vocab), (torch.randn(rows, 64),
                                           torch.randint(0, vocab, (rows,))),
                         F.cross_entropy).graph
    from torchalpa.passes.pricing.fused_pricing import recomputed
    fp32_logits = rows * vocab * 4
    eager, fused = _peak(graph, False), _peak(graph, True)
    assert eager >= 3 * fp32_logits
    assert fused <= fp32_logits + 0.1 * fp32_logits        # bf16 logits + bf16 gradient
    never_held = {graph.node(name).op for name in recomputed(priced_as(graph, "fused"))}
    assert {"aten._to_copy.default", "aten._log_softmax.default", "aten.scatter.value",
            "aten._log_softmax_backward_data.default"} <= never_held
    assert recomputed(priced_as(graph, "eager")) != {} and recomputed(graph) != {}
    # the liveness of a graph priced fused is the compiled one by default
    assert _peak(priced_as(graph, "fused"), None) == fused
    # the casts to bf16 that the matmuls read (the input, the logits' gradient) are held
    to_bf16 = [n.name for n in graph if n.op == "aten._to_copy.default"
               and str(n.output.dtype).endswith("bfloat16") and n.output.numel > 1]
    assert len(to_bf16) == 2 and not set(to_bf16) & set(recomputed(graph))


def test_a_compiled_cross_entropy_moves_its_bf16_logits_not_float32_copies():
    # the step's time follows the rule of what it holds (``recomputed``): the cast,
    # log-softmax, gather, one-hot fill and scatter are written by no kernel; forward reads
    # the bf16 logits once, backward reads them again (log-softmax recomputed from its
    # source) and writes the bf16 gradient: 6 bytes a logit (eager: ~40)
    torch.manual_seed(0)
    rows, vocab = 256, 4096
    graph = capture_step(Bf16Head(vocab), (torch.randn(rows, 64),
                                           torch.randint(0, vocab, (rows,))),
                         F.cross_entropy).graph
    bf16_logits = rows * vocab * 2

    def loss_bytes(g):
        return sum(n.bytes for n in g if not n.is_leaf and not n.aliases
                   and n.op != "aten.mm.default" and n.output.numel >= rows * vocab)
    fused = priced_as(graph, "fused")
    assert loss_bytes(graph) >= 15 * bf16_logits
    assert 3 * bf16_logits <= loss_bytes(fused) <= 3.1 * bf16_logits
    ops = {n.op: n.bytes for n in fused}
    assert ops["aten._log_softmax.default"] == 0 and ops["aten.scatter.value"] == 0
    # backward's log-softmax gradient reads the bf16 logits it is recomputed from
    assert ops["aten._log_softmax_backward_data.default"] == bf16_logits


def test_a_residual_stream_kept_for_backward_is_written_not_recomputed_from_every_layer():
    # the residual adds are pointwise and their readers fuse, but backward (the recompute
    # of full checkpointing) reads them: they are kept, so written, and each block's
    # recomputed layer norm reads one block input, not the sources of every add before it
    from torchalpa.frontends.block_remat import checkpointed_capture
    from torchalpa.frontends.torch_export import capture
    from torchalpa.models import gpt
    torch.manual_seed(0)
    config = gpt.GPTConfig.tiny(num_layers=6, dropout=0.0)
    captured = capture(gpt.GPT(config), gpt.example_batch(config, 2), gpt.loss_fn)
    graph = priced_as(checkpointed_capture(captured, "full").graph, "fused")
    recomputed_norms = [n.bytes for n in graph if n.op == "aten.native_layer_norm.default"
                        and n.phase == "backward"]
    assert len(recomputed_norms) == 2 * 6
    assert len(set(recomputed_norms)) <= 2         # ln_1 and ln_2, alike in every block
