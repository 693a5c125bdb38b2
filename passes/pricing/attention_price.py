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

``attention_backward_flops`` prices the three cases from the shapes of the
backward's results (``grad_query``, ``grad_key``, ``grad_value`` have the shapes of
``q``, ``k``, ``v``); ``saved_statistics`` pairs each forward with the backward the
lowering rewrites, for the memory model (the output is kept until then whether or not the
fused kernel applies; the statistic where it does). A mask of a dtype other than the query's
or bool also takes the math path on CPU; the node does not carry the mask's dtype, so
such a call is priced as fused (rare: masks are bool or the query's dtype).
"""

from __future__ import annotations

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import Operand, OpGraph, OpNode, TensorSpec
from torchalpa.ops.attention import SDPA_BACKWARD_OP, SDPA_BIAS_BACKWARD_OP, SDPA_OP

__all__ = ["runs_on_cpu", "attention_backward_flops", "saved_statistics", "saves_statistic",
           "statistic_spec", "ATTENTION_BACKWARDS"]

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
    return forward + backward + scores


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
