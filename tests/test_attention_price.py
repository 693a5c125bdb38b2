"""Attention's backward is priced as it runs (``passes/pricing/attention_price.py``): on CPU ranks
the fused backward reads the forward's saved statistic (the four products and ``q k^T``
again), on CUDA it runs the forward again first, with grouped heads on CPU the math path
recomputes; and the memory model holds the saved output and log-sum-exp until backward."""

from __future__ import annotations

import copy
import functools
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from torchalpa.core import gpu_specs
from torchalpa.core.cluster import Cluster
from torchalpa.core.opgraph import Operand, OpNode, TensorSpec
from torchalpa.core.placement import Replicate, Shard
from torchalpa.ops import attention
from torchalpa.parallel.workflow import capture_step
from torchalpa.passes.pricing.attention_price import (
    attention_backward_flops,
    causal_share,
    exponentials,
    head_dim_seconds,
    saved_statistics,
    saves_statistic,
    statistic_spec,
)
from torchalpa.passes.pricing.cost import compute_cost, op_flops
from torchalpa.passes.pricing.memory import activation_peak_bytes, liveness
from torchalpa.runtime.rewrites.attention_statistics import save_attention_statistics

B, H, L, E = 2, 4, 8, 16


class SelfAttention(torch.nn.Module):
    def __init__(self, kv_heads: int = H):
        super().__init__()
        self.q = torch.nn.Linear(E, H * E)
        self.kv = torch.nn.Linear(E, 2 * kv_heads * E)
        self.kv_heads = kv_heads

    def forward(self, x):
        q = self.q(x).view(B, L, H, E).transpose(1, 2)
        k, v = self.kv(x).view(B, L, 2, self.kv_heads, E).permute(2, 0, 3, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=self.kv_heads != H)
        return out.transpose(1, 2).reshape(B, L, H * E)


@functools.lru_cache(maxsize=2)
def _captured(kv_heads: int = H):
    torch.manual_seed(0)
    return capture_step(SelfAttention(kv_heads), (torch.randn(B, L, E), torch.randn(B, L, H * E)),
                        F.mse_loss)


def _graph(kv_heads: int = H):
    return _captured(kv_heads).graph


def _nodes(graph, op):
    return [n for n in graph.ops() if n.op == op]


CPU = Cluster.local_cpu(2).logical_mesh((2,))
GPU = Cluster.h100(num_nodes=1, devices_per_node=2).logical_mesh((2,))
PRODUCT = 2.0 * B * H * L * L * E          # one of q k^T, p v, or a backward product


def test_backward_flops_follow_the_device():
    graph = _graph()
    backward, = _nodes(graph, attention.SDPA_BACKWARD_OP)
    # as captured: the forward again (2) + a fused backward (4 products + q k^T again)
    assert backward.flops == 7 * PRODUCT
    assert attention_backward_flops(CPU, backward) == 5 * PRODUCT
    assert attention_backward_flops(GPU, backward) == 7 * PRODUCT


def test_grouped_heads_take_the_math_path_on_cpu():
    graph = _graph(kv_heads=2)
    forward, = _nodes(graph, attention.SDPA_OP)
    backward, = _nodes(graph, attention.SDPA_BACKWARD_OP)
    assert attention_backward_flops(CPU, backward) == 6 * PRODUCT  # forward, 4 products
    assert attention_backward_flops(GPU, backward) == backward.flops == 7 * PRODUCT
    # the lowering still hands the output to the backward, with an empty statistic
    assert saved_statistics(graph, CPU) == {forward.name: backward.name}
    assert not saves_statistic(graph, forward)


@pytest.mark.parametrize("kv_heads", [H, 2])
def test_the_pairs_are_the_ones_the_cpu_lowering_rewrites(kv_heads):
    captured = _captured(kv_heads)
    rewritten = save_attention_statistics(copy.deepcopy(captured.gm).graph,
                                          torch.device("cpu"))
    assert rewritten == len(saved_statistics(captured.graph, CPU)) == 1


def test_cpu_forward_keeps_output_and_statistic_until_backward():
    graph = _graph()
    forward, = _nodes(graph, attention.SDPA_OP)
    backward, = _nodes(graph, attention.SDPA_BACKWARD_OP)
    assert saved_statistics(graph, CPU) == {forward.name: backward.name}
    assert saved_statistics(graph, GPU) == {}
    order = [n.name for n in graph]
    live = liveness(graph, saved_statistics(graph, CPU))
    assert live.end[live.names.index(forward.name)] == order.index(backward.name)
    # the statistic is the one the fused CPU kernel saves
    q, k, v = (torch.randn(B, H, L, E) for _ in range(3))
    _, logsumexp = attention.sdpa_forward_saving(q, k, v, None, True, None, False)
    spec = statistic_spec(forward)
    assert (tuple(logsumexp.shape), str(logsumexp.dtype).removeprefix("torch.")) == \
        (spec.shape, spec.dtype)
    # held from forward to backward: the peak grows by at most its bytes, split by heads
    # like the output (and whole when the output splits its features)
    outputs = {n.name: (tuple(Replicate() for _ in range(1)),) * len(n.outputs)
               for n in graph}
    plain, _ = activation_peak_bytes(graph, outputs, (2,))
    kept, _ = activation_peak_bytes(graph, outputs, (2,), saved_statistics(graph, CPU))
    assert plain < kept <= plain + forward.output.nbytes + spec.nbytes
    heads = dict(outputs, **{forward.name: ((Shard(1),),)})
    split, _ = activation_peak_bytes(graph, heads, (2,), saved_statistics(graph, CPU))
    assert split < kept


# -- the head dim: one exponential per score, whatever the head dim --------------------------

def _attention_pair(batch: int, heads: int, length: int, dim: int):
    """A causal self-attention's captured forward and backward of these shapes, built by
    hand as the capture records them (flops counted in full: torch's counter)."""
    q = TensorSpec((batch, heads, length, dim), "bfloat16")
    product = 2.0 * batch * heads * length * length * dim
    forward = OpNode(name="f", op=attention.SDPA_OP, kind="op", outputs=(q,),
                     flops=2 * product, bytes=4.0 * q.nbytes,
                     args=(Operand(0), Operand(1), Operand(2), None, True))
    backward = OpNode(name="b", op=attention.SDPA_BACKWARD_OP, kind="op", outputs=(q, q, q),
                      flops=7 * product, bytes=7.0 * q.nbytes,
                      args=(Operand(0), Operand(1), Operand(2), Operand(3), None, True))
    return forward, backward


def _per_flop(mesh, node) -> float:
    return compute_cost(mesh, node, 1) / op_flops(mesh, node)


A100 = Cluster.preset("dgx-a100").logical_mesh((8,))
H100 = Cluster.preset("h100").logical_mesh((8,))


def test_exponentials_count_the_scores_each_op_computes():
    forward, backward = _attention_pair(2, 12, 1024, 64)
    scores = 2 * 12 * 1024 * 1024 * causal_share(1024, 1024)
    assert exponentials(A100, forward) == pytest.approx(scores)
    assert exponentials(A100, backward) == pytest.approx(2 * scores)   # forward again + P
    assert exponentials(CPU, backward) == 0.0                            # no fused CUDA kernel
    assert head_dim_seconds(CPU, backward) == 0.0


def test_head_dim_64_runs_slower_per_flop_than_128_and_256_faster():
    """At the figure's head dim (128) nothing changes; half the head dim takes twice the
    exponentials per flop, a larger one half of them."""
    for mesh in (A100, H100):
        for node_index in (0, 1):
            per_flop = {d: _per_flop(mesh, _attention_pair(8, 16, 2048, d)[node_index])
                        for d in (64, 128, 256)}
            assert head_dim_seconds(mesh, _attention_pair(8, 16, 2048, 128)[node_index]) == 0.0
            assert per_flop[64] > per_flop[128] > per_flop[256]


def test_the_exponentials_weigh_more_where_the_tensor_cores_outrun_them():
    """H100: 989 TFLOP/s of bf16 matmul for 4.2e12 exponentials/s; A100: 312 for 2.4e12.
    Its attention figure (0.35 of the peak, 0.55 on A100) is low for that reason, and head
    dim 64 costs it more of its figure's time."""
    h100 = gpu_specs.lookup("NVIDIA H100 80GB HBM3")
    assert h100 is not None
    assert gpu_specs.exp_rate(h100) == pytest.approx(3.9e12, rel=0.1)  # FlashAttention-3's
    slower = {}
    for name, mesh in (("a100", A100), ("h100", H100)):
        forward_64 = _attention_pair(8, 16, 2048, 64)[0]
        figure = op_flops(mesh, forward_64) / mesh.peak_flops_for("bfloat16", "sdpa")
        slower[name] = head_dim_seconds(mesh, forward_64) / figure
    assert 0.05 < slower["a100"] < slower["h100"] < 0.5
    without = replace(A100, exp_rate=0.0)       # a GPU whose clock is not listed
    assert head_dim_seconds(without, _attention_pair(8, 16, 2048, 64)[0]) == 0.0
