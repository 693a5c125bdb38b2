"""What attention's backward costs, and what its forward keeps for it, as the program runs.

The captured ``torchalpa::sdpa_backward`` gets only attention's inputs and runs the
forward again (``torchalpa/ops/attention.py``); its recorded flops say so (one forward plus a
fused backward: torch's count, the four products and ``q k^T`` again). What runs depends
on the devices:

- CPU ranks (gloo), same number of query and key heads, a floating dtype the fused CPU
  kernel takes, no learned mask: the lowering saves the fused forward's output and its
  log-sum-exp per query row and the backward reads both
  (``runtime/rewrites/attention_statistics.py``). No second forward, but the fused backward, working by
  blocks, recomputes the scores ``q k^T`` from the statistic: backward = the four
  products + ``q k^T``. The forward keeps its output ``(B, Hq, L, Ev)`` and the
  statistic ``(B, Hq, L)`` in float32 until the backward.
- other CPU calls (grouped heads, a learned mask): the math path, under autograd: the
  forward again, then its backward from the probabilities that forward kept: one
  forward + the four products.
- CUDA ranks (NCCL): the forward again with a fused kernel (flash or memory-efficient),
  then that kernel's backward, which also recomputes ``q k^T``: one forward + the four
  products + ``q k^T`` (what the capture records). The fused forward's statistic lives
  only inside the backward op.

On CUDA a causal call (``is_causal=True``) runs only the blocks of scores on or below the
diagonal: flash and memory-efficient kernels skip a block of ``KERNEL_BLOCK`` queries by
``KERNEL_BLOCK`` keys that the mask removes whole, so forward and backward do about half
the products of a full attention (``causal_share``; the capture counts causal attention
in full, as PyTorch's and Megatron's flop formulas do). Their rate is the GPU's fused
attention figure (``GpuSpec.attention``, FlashAttention-2's published flop/s counted the
same way). The CPU kernel's blocking is priced as counted.

The attention figure is a rate at head dim 128 (``REFERENCE_HEAD_DIM``). A fused kernel's
softmax takes one exponential per score it computes, whatever the head dim, on the
special-function units, while its products take ``4 x head dim`` flops per score on the
tensor cores; FlashAttention-2-style kernels do not overlap the two (FlashAttention-3's
point: on an H100, 989 TFLOP/s of matmul against 3.9 TFLOPS of exponentials, so at head
dim 128 the exponentials can take half as long as the products). At head dim ``d`` the same
flops take ``128 / d`` times as many exponentials: ``head_dim_seconds`` adds
``exponentials x (1 - d / 128) / LogicalMesh.exp_rate`` to the figure's time (head dim 64:
GPT-2 small, MPT-125M; a larger head dim runs faster per flop).

``attention_backward_flops`` prices the three cases from the shapes of the
backward's results (``grad_query``, ``grad_key``, ``grad_value`` have the shapes of
``q``, ``k``, ``v``); ``saved_statistics`` pairs each forward with the backward the
lowering rewrites, for the memory model (the output is kept until then whether or not the
fused kernel applies; the statistic where it does). A mask of a dtype other than the query's
or bool also takes the math path on CPU; the node does not carry the mask's dtype, so
such a call is priced as fused (rare: masks are bool or the query's dtype).
"""

from __future__ import annotations

import math

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import Operand, OpGraph, OpNode, TensorSpec
from torchalpa.ops.attention import SDPA_BACKWARD_OP, SDPA_BIAS_BACKWARD_OP, SDPA_OP

__all__ = ["runs_on_cpu", "attention_backward_flops", "saved_statistics", "saves_statistic",
           "statistic_spec", "ATTENTION_BACKWARDS", "attention_forward_flops", "causal_share",
           "KERNEL_BLOCK", "attention_backward_share", "BACKWARD_RATE", "REFERENCE_HEAD_DIM",
           "exponentials", "head_dim_seconds"]

KERNEL_BLOCK = 128
"""Queries (and keys) per block of a fused CUDA attention kernel (FlashAttention-2's
128 x 64 / 128 x 128 tiles, PyTorch's memory-efficient kernel's 64-128)."""

BACKWARD_RATE = 0.7
"""The fused CUDA attention backward's flop/s over its forward's: it runs five products per
block where the forward runs two, recomputes the probabilities, and sums ``d query`` over
the key blocks with atomic float32 adds (FlashAttention-2: 63 % of A100's peak backward
against 73 % forward, Dao 2023; on the H200 of 2026-11-28 GPT-2's backward reached 0.70 of
its forward's rate: ``benchmarks/gpu_logs/h200-2026-11-28/ops.log``)."""

REFERENCE_HEAD_DIM = 128
"""Head dim the GPU's fused-attention figure (``GpuSpec.attention``) stands for: the heads
of the large models (LLaMA, GPT-3 6.7B and up, MPT 760M and up) it is priced against."""

ATTENTION_BACKWARDS = frozenset({SDPA_BACKWARD_OP, SDPA_BIAS_BACKWARD_OP})
_CPU_FUSED_DTYPES = frozenset({"float32", "float64", "bfloat16", "float16"})


def runs_on_cpu(mesh: LogicalMesh) -> bool:
    """Whether the mesh's ranks are CPU processes: the runtime talks gloo exactly there
    (NCCL on CUDA, ``runtime/execution/mesh.py``)."""
    return mesh.backend == "gloo"


def _cpu_fused(op: str, query: TensorSpec, key: TensorSpec) -> bool:
    """Whether the fused CPU kernel computes this attention, so the lowering saves its
    statistic (``attention._cpu_flash_mask``, as far as shapes and dtypes tell)."""
    return (op != SDPA_BIAS_BACKWARD_OP and len(query.shape) == 4
            and query.dtype in _CPU_FUSED_DTYPES and key.shape[-3] == query.shape[-3])


def _products(query, key, value) -> tuple[float, float]:
    """(flops of ``q k^T``, flops of ``p v``) with the key/value heads repeated to the
    query's (grouped-query attention computes every query head)."""
    *batch, length, dim = query
    source, dim_v = key[-2], value[-1]
    rows = 1
    for n in batch:
        rows *= n
    return 2.0 * rows * length * source * dim, 2.0 * rows * length * source * dim_v


def causal_share(length: int, source: int) -> float:
    """Share of a causal attention's ``length x source`` scores a fused CUDA kernel
    computes: the ``KERNEL_BLOCK``-square blocks on or below the diagonal (the mask of
    ``is_causal``: ``ones(length, source).tril()``, aligned top-left)."""
    if length <= 0 or source <= 0:
        return 1.0
    rows = -(-length // KERNEL_BLOCK)
    cols = -(-source // KERNEL_BLOCK)
    computed = sum(min(cols, r + 1) for r in range(rows))
    return computed / (rows * cols)


def _is_causal(node: OpNode, position: int) -> bool:
    """The ``is_causal`` argument of a captured attention op (forward: 5th, backward: 6th)."""
    return len(node.args) > position and node.args[position] is True


def attention_forward_flops(mesh: LogicalMesh, node: OpNode) -> float:
    """Flops of one attention forward (``torchalpa::sdpa``) as it runs on ``mesh``'s
    devices: a causal call on CUDA computes ``causal_share`` of what the capture counts
    (as many keys as queries: the result's length; a causal call is self-attention)."""
    out = node.outputs[0].shape if node.outputs else ()
    if runs_on_cpu(mesh) or not _is_causal(node, 4) or len(out) < 2:
        return node.flops
    return node.flops * causal_share(out[-2], out[-2])


def attention_backward_flops(mesh: LogicalMesh, node: OpNode) -> float:
    """Flops of one attention backward as it runs on ``mesh``'s devices (module doc)."""
    query, key, value = (spec.shape for spec in node.outputs[:3])
    scores, weighted = _products(query, key, value)
    forward = scores + weighted
    backward = 2 * forward                       # d value, d probabilities, d query, d key
    if runs_on_cpu(mesh):
        if _cpu_fused(node.op, node.outputs[0], node.outputs[1]):
            return backward + scores
        return forward + backward
    share = causal_share(query[-2], key[-2]) if _is_causal(node, 5) else 1.0
    return (forward + backward + scores) * share


def attention_backward_share(mesh: LogicalMesh, node: OpNode) -> float:
    """The share of the fused attention rate a CUDA attention backward reaches over all the
    flops it runs (``attention_backward_flops``): the forward it runs again at the rate,
    the backward's products and ``q k^T`` at ``BACKWARD_RATE`` of it. 1.0 for other ops
    and on CPU ranks (priced as counted)."""
    if node.op not in ATTENTION_BACKWARDS or len(node.outputs) < 3 or runs_on_cpu(mesh):
        return 1.0
    query, key, value = (spec.shape for spec in node.outputs[:3])
    scores, weighted = _products(query, key, value)
    forward, rest = scores + weighted, 2 * (scores + weighted) + scores
    return (forward + rest) / (forward + rest / BACKWARD_RATE)


def exponentials(mesh: LogicalMesh, node: OpNode) -> float:
    """Exponentials a fused CUDA attention op computes: one per score of the blocks it runs
    (``causal_share`` of them when causal), twice for a backward, which runs the forward
    again and recomputes the probabilities from the statistic; 0.0 for other ops and on
    CPU ranks. A forward's keys are read from its recorded flops (two products of
    ``2 x rows x queries x keys x head dim``; a causal call has as many keys as queries)."""
    if runs_on_cpu(mesh) or not node.outputs or len(node.outputs[0].shape) < 2:
        return 0.0
    *batch, length, dim = node.outputs[0].shape
    rows = math.prod(batch)
    if node.op in ATTENTION_BACKWARDS and len(node.outputs) >= 3:
        keys, causal, passes = node.outputs[1].shape[-2], _is_causal(node, 5), 2
    elif node.op == SDPA_OP and rows and length and dim:
        causal, passes = _is_causal(node, 4), 1
        keys = length if causal else round(node.flops / (4.0 * rows * length * dim))
    else:
        return 0.0
    share = causal_share(length, keys) if causal else 1.0
    return float(passes * rows * length * keys * share)


def head_dim_seconds(mesh: LogicalMesh, node: OpNode) -> float:
    """Seconds a fused CUDA attention op takes beyond its flops at the attention figure, for
    its head dim (module doc): ``exponentials x (1 - d / REFERENCE_HEAD_DIM) / exp_rate``,
    ``d`` the last dim of its first result (a backward's ``grad_query``; a forward's output,
    whose value head dim fused kernels take equal to the query's); negative above 128; 0.0
    without ``mesh.exp_rate``."""
    count = exponentials(mesh, node) if mesh.exp_rate else 0.0
    if not count:
        return 0.0
    dim = node.outputs[0].shape[-1]
    return count * (1.0 - dim / REFERENCE_HEAD_DIM) / mesh.exp_rate


def statistic_spec(forward: OpNode) -> TensorSpec:
    """The log-sum-exp the fused CPU forward keeps: one float32 per query row."""
    return TensorSpec(tuple(forward.output.shape[:-1]), "float32")


def saved_statistics(graph: OpGraph, mesh: LogicalMesh) -> dict[str, str]:
    """Attention forward -> the backward that reads what it saves, for each pair the CPU
    lowering rewrites (same operands and options, no keyword arguments): the backward
    reads the forward's output, and its statistic where ``saves_statistic``; empty on
    other devices."""
    if not runs_on_cpu(mesh):
        return {}
    forwards: dict[tuple, str] = {}
    for node in graph.ops():
        if node.op == SDPA_OP and not node.kwargs:
            forwards.setdefault((node.operands, node.args), node.name)
    pairs: dict[str, str] = {}
    for node in graph.ops():
        if node.op != SDPA_BACKWARD_OP or node.kwargs:
            continue
        key = (node.operands[1:], _shifted(node.args))
        name = forwards.pop(key, None)
        if name is not None:
            pairs[name] = node.name
    return pairs


def saves_statistic(graph: OpGraph, forward: OpNode) -> bool:
    """Whether the fused CPU kernel computes this attention forward, so its rewritten
    form keeps a log-sum-exp (else an empty one, and the backward recomputes)."""
    query, key = (graph.spec(ref) for ref in forward.operands[:2])
    return _cpu_fused(SDPA_BACKWARD_OP, query, key)


def _shifted(args: tuple) -> tuple:
    """A backward's arguments without ``grad_out``, operand positions renumbered as the
    forward's (its operand ``i + 1`` is the forward's ``i``)."""
    return tuple(Operand(a.k - 1) if isinstance(a, Operand) else a for a in args[1:])
