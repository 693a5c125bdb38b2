"""Rewrite one ATen call of the global program for the local blocks of this rank.

Most ops work on blocks unchanged: their non-tensor arguments name dims, or positions
along dims that their rule keeps whole (``passes/rules``: a cut, gathered, padded or
normalized dim is blocked, so its sizes and indices stay valid on every block). The ops
left are those whose arguments spell out sizes of dims that may be split; ``_REWRITES``
maps each to a small function that puts in the local sizes:

- shapes of views, expands and factories become the local shape of the result (a view
  becomes a reshape: the local block may not have the strides the view assumed);
- ``*_like`` factories become ``full`` of the local shape (their operand is read for shape
  only and is not resharded, so it may not have the result's layout);
- ``repeat`` repeats each local block as many times as fit its local result;
- ``squeeze`` removes only the dims that are 1 globally (a split dim may be 1 locally);
- a split into equal pieces of a dim held strided splits into the pieces' local blocks;
- grouped convolutions hold ``groups / k`` whole groups when channels are split k ways,
  and ``convolution_backward``'s ``bias_sizes`` is the local channel count;
- group norm's ``N`` and ``C`` are the block's, and it holds ``group / k`` whole groups
  when channels are split k ways;
- an upsampling backward's ``input_size`` is the local shape of its result;
- an embedding table split by rows (the vocabulary) looks up and accumulates gradients
  for its own rows only, at this rank's row offset (``runtime.lowering.vocab``), and so do a gather
  or scatter along a split dim (positions are translated, others' positions skipped);
- the fused cross-entropy's backward on a split vocabulary computes its block's columns
  (``ops.cross_entropy.backward_block``: the target's term where the block owns it, the
  smoothing over the whole vocabulary).
- weight norm's backward gets its operands contiguous: ATen's kernel reads them as if they
  were (a transposed gradient gives wrong numbers, silently), and autograd's formula
  passes ``grad.contiguous()``, a call the trace drops where the traced gradient was
  already contiguous -- a rank's block, gathered by a collective, may not be.

Device arguments point at this rank's device (the graph may have been captured on
``meta``). A random op whose result is sharded becomes a draw of this rank's block from
the block's own generator (``runtime.lowering.random_draws``), which needs the rank's mesh ``coords``.
Every op is checked to have a kernel for the target device type
(``runtime.lowering.device_ops``): a CPU-only kernel in a program for CUDA fails here, on any
machine, with the op and the model line that made it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten

import torchalpa.ops.batched_matmul  # noqa: F401  (registers torchalpa::batched_matmul, which programs call)
from torchalpa.core.placement import Shard, is_shard, local_shape
from torchalpa.core.plan import NodeStrategy
from torchalpa.core.resize_ops import UPSAMPLE_BACKWARDS
from torchalpa.ops import cross_entropy as CE
from torchalpa.runtime.lowering import random_draws as R
from torchalpa.runtime.lowering import vocab as V
from torchalpa.runtime.lowering.device_ops import check_op

__all__ = ["localize", "weight_norm_backward"]

aten = torch.ops.aten


@dataclass
class _Call:
    """One call being localized: its fx node, arguments and chosen layouts."""

    node: torch.fx.Node
    args: list
    kwargs: dict
    strategy: NodeStrategy
    mesh_shape: tuple
    device: torch.device
    coords: tuple | None = None

    def out_shape(self, i: int = 0) -> list[int]:
        """Local shape of result ``i``."""
        val = self.node.meta["val"]
        val = val[i] if isinstance(val, (tuple, list)) else val
        return list(local_shape(tuple(val.shape), self.strategy.outputs[i], self.mesh_shape))

    def global_in_shape(self, k: int) -> tuple[int, ...]:
        """Global shape of tensor operand ``k``."""
        operands = [a for a in tree_flatten((list(self.node.args), dict(self.node.kwargs)))[0]
                    if isinstance(a, torch.fx.Node)]
        return tuple(operands[k].meta["val"].shape)

    def in_shape(self, k: int) -> list[int]:
        """Local shape of tensor operand ``k`` (as it is read: resharded to its placement)."""
        placements = self.strategy.inputs[k]
        assert placements is not None, f"{self.node.name}: tensor operand {k} has no layout"
        return list(local_shape(self.global_in_shape(k), placements, self.mesh_shape))

    def splits(self, k: int, dim: int) -> int:
        """Into how many blocks operand ``k`` is split along ``dim``."""
        return math.prod(self.mesh_shape[axis] for axis, p in enumerate(self.strategy.inputs[k] or ())
                         if is_shard(p) and p.dim == dim)

    def with_arg(self, index: int, value):
        args = list(self.args)
        args[index] = value
        return self.node.target, args, self.kwargs


def _shape_arg(index: int) -> Callable[[_Call], tuple]:
    return lambda c: c.with_arg(index, c.out_shape())


def _like(fill: Callable[[list], object]) -> Callable[[_Call], tuple]:
    def rewrite(c: _Call):
        val = c.node.meta["val"]
        return aten.full.default, [c.out_shape(), fill(c.args)], {"dtype": val.dtype,
                                                                 "device": c.device}
    return rewrite


def _strided(c: _Call):
    """``new_empty_strided(x, size, stride)`` (functionalization's buffer for a copy into a
    strided view) on a block: the block's shape, strides of the same dim order (dims by
    falling global stride) packed for that shape, so the block keeps the buffer's layout."""
    shape, stride = c.out_shape(), list(c.args[2])
    order = sorted(range(len(shape)), key=lambda d: -stride[d])
    local, step = [0] * len(shape), 1
    for d in reversed(order):
        local[d] = step
        step *= max(shape[d], 1)
    return aten.new_empty_strided.default, [c.args[0], shape, local], c.kwargs


def _repeat(c: _Call):
    out, src = c.out_shape(), c.in_shape(0)
    lead = len(out) - len(src)
    repeats = out[:lead] + [o // s if s else 1 for o, s in zip(out[lead:], src)]
    return c.with_arg(1, repeats)


def _conv(input_slot: int, groups_index: int) -> Callable[[_Call], tuple]:
    def rewrite(c: _Call):
        args = list(c.args)
        if args[groups_index] > 1:  # whole groups per block: channels split k ways
            args[groups_index] //= c.splits(input_slot, 1)
        if c.node.target is aten.convolution_backward.default and args[3] is not None:
            args[3] = [c.in_shape(0)[1]]  # bias_sizes: grad_output's local channels
        return c.node.target, args, c.kwargs
    return rewrite


def _group_norm(first_int: int) -> Callable[[_Call], tuple]:
    """``native_group_norm[_backward]``: (N, C, HxW, group) start at ``first_int``."""
    def rewrite(c: _Call):
        args = list(c.args)
        args[first_int], args[first_int + 1] = c.in_shape(0)[:2]
        args[first_int + 3] //= c.splits(0, 1)
        return c.node.target, args, c.kwargs
    return rewrite


def _squeeze(c: _Call):
    # squeeze only the dims that are 1 globally: a split dim may be 1 locally
    shape = c.global_in_shape(0)
    if c.node.target is aten.squeeze.default:
        asked = range(len(shape))
    else:
        dims = c.args[1]
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        asked = [d % max(len(shape), 1) for d in dims]
    return aten.squeeze.dims, [c.args[0], [d for d in asked if shape[d] == 1]], c.kwargs


def _split_pieces(c: _Call):
    # a dim cut into equal pieces and held strided: each piece's local block is the
    # piece's size over the splits (the pieces themselves stay whole in number)
    dim = c.args[2] if len(c.args) > 2 else c.kwargs.get("dim", 0)
    dim = dim % len(c.global_in_shape(0))
    n = c.splits(0, dim)
    if n == 1:
        return c.node.target, c.args, c.kwargs
    sizes = c.args[1]
    local = [s // n for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // n
    return c.with_arg(1, local)


def _vocab(c: _Call):
    # a table split by rows: global indices become this block's rows, others look up zeros
    backward = c.node.target is aten.embedding_dense_backward.default
    names = ("grad_output" if backward else "weight", "indices",
             "num_weights" if backward else "padding_idx",
             "padding_idx" if backward else "scale_grad_by_freq",
             "scale_grad_by_freq" if backward else "sparse")
    values = [c.args[i] if i < len(c.args) else c.kwargs.get(name, -1 if "padding" in name
                                                              else False)
              for i, name in enumerate(names)]
    table = c.strategy.outputs[0] if backward else c.strategy.inputs[0]
    if not any(isinstance(p, Shard) and p.dim == 0 for p in table or ()):
        return c.node.target, c.args, c.kwargs
    assert c.coords is not None, f"localizing vocab-parallel {c.node.name} needs coords"
    rows = values[2] if backward else c.global_in_shape(0)[0]
    offset, local_rows = V.row_offset(rows, 0, table, c.mesh_shape, c.coords)
    if backward:
        grad, indices, _, padding, by_freq = values
        return V.dense_backward, [grad, indices, local_rows, offset, padding, bool(by_freq)], {}
    weight, indices, padding, by_freq, sparse = values
    return V.lookup, [weight, indices, offset, padding, bool(by_freq), bool(sparse)], {}


def _addressed(c: _Call):
    # gather / scatter along a split dim: global positions become this block's, the
    # positions other blocks own pick zeros (gather) or are not written (scatter)
    dim = c.args[1]
    placements = c.strategy.inputs[0]
    rank = len(c.global_in_shape(0))
    dim = dim + rank if dim < 0 else dim
    if not any(isinstance(p, Shard) and p.dim == dim for p in placements or ()):
        return c.node.target, c.args, c.kwargs
    assert c.coords is not None, f"localizing {c.node.name} along a split dim needs coords"
    offset, _ = V.row_offset(c.global_in_shape(0)[dim], dim, placements, c.mesh_shape,
                             c.coords)
    if c.node.target is aten.gather.default:
        sparse = c.args[3] if len(c.args) > 3 else c.kwargs.get("sparse_grad", False)
        return V.gather_block, [c.args[0], dim, c.args[2], offset, bool(sparse)], {}
    op = str(c.node.target).removeprefix("aten.")
    return V.scatter_block, [op, c.args[0], dim, c.args[2], offset, *c.args[3:]], c.kwargs


def _loss_block(c: _Call):
    # the fused cross-entropy's backward on a block of the vocabulary: the target's term
    # where this block owns it, the smoothing spread over the whole vocabulary
    placements = c.strategy.inputs[1]
    vocab = c.global_in_shape(1)[1]
    if not any(isinstance(p, Shard) and p.dim == 1 for p in placements or ()):
        return c.node.target, c.args, c.kwargs
    assert c.coords is not None, f"localizing {c.node.name} on a split vocabulary needs coords"
    offset, _ = V.row_offset(vocab, 1, placements, c.mesh_shape, c.coords)
    return CE.backward_block, [*c.args, offset, vocab], {}


def weight_norm_backward(grad_w, saved_v, saved_g, saved_norms, dim):
    """``aten._weight_norm_interface_backward`` on contiguous operands, as autograd calls
    it (``derivatives.yaml``: ``grad.contiguous()``); its CPU kernel ignores strides."""
    return aten._weight_norm_interface_backward.default(
        grad_w.contiguous(), saved_v.contiguous(), saved_g.contiguous(),
        saved_norms.contiguous(), dim)


def _contiguous_weight_norm(c: _Call):
    return weight_norm_backward, c.args, c.kwargs


def _reshape(c: _Call):
    """A view as a reshape of the local block: a view where the block's strides allow
    one, a copy where they do not. The source graph's view was valid for the strides one
    device had (CPU attention writes its (B, H, S, D) output as (B, S, H, D) in memory,
    so the model's transpose-then-view is free there); the block a rank holds may come
    from a collective, contiguous in the logical order, which such a view cannot read.
    The traced step is functional (nothing writes through a view), so a copy changes
    no result."""
    return aten.reshape.default, [c.args[0], c.out_shape()], {}


_REWRITES: dict[str, Callable[[_Call], tuple]] = {
    **{op: _reshape for op in ("aten.view.default", "aten._unsafe_view.default",
                               "aten.reshape.default")},
    **{op: _shape_arg(1) for op in (
        "aten.expand.default", "aten.new_zeros.default", "aten.new_ones.default",
        "aten.new_empty.default", "aten.new_full.default")},
    **{op: _shape_arg(0) for op in (
        "aten.full.default", "aten.zeros.default", "aten.ones.default",
        "aten.empty.memory_format", "aten.empty_permuted.default")},
    "aten.full_like.default": _like(lambda args: args[1]),
    "aten.zeros_like.default": _like(lambda args: 0),
    "aten.ones_like.default": _like(lambda args: 1),
    "aten.empty_like.default": _like(lambda args: 0),
    "aten.repeat.default": _repeat,
    "aten.new_empty_strided.default": _strided,
    "aten.squeeze.default": _squeeze,
    "aten.squeeze.dim": _squeeze,
    "aten.squeeze.dims": _squeeze,
    "aten.convolution.default": _conv(0, 8),
    "aten.convolution_backward.default": _conv(1, 9),
    "aten.native_group_norm.default": _group_norm(3),
    "aten.native_group_norm_backward.default": _group_norm(5),
    **{op: _shape_arg(2) for op in UPSAMPLE_BACKWARDS},     # input_size
    "aten.split.Tensor": _split_pieces,
    "aten.split_with_sizes.default": _split_pieces,
    "aten.embedding.default": _vocab,
    "aten.embedding_dense_backward.default": _vocab,
    "torchalpa.cross_entropy_backward.default": _loss_block,
    "aten._weight_norm_interface_backward.default": _contiguous_weight_norm,
    **{op: _addressed for op in (
        "aten.gather.default", "aten.scatter.src", "aten.scatter.value",
        "aten.scatter_add.default", "aten.scatter_reduce.two")},
}


def localize(node, args: list, kwargs: dict, strategy: NodeStrategy, mesh_shape,
             device: torch.device, coords=None):
    """(target, args, kwargs) of the local call for fx ``node`` under ``strategy``, on the
    rank at mesh coordinate ``coords`` (needed for sharded random ops only)."""
    if node.target is aten._to_copy.default:
        # every tensor of a local program is on this rank's device, so a cast needs only its
        # dtype: without device= and layout= (a cast's backward records both) the call takes
        # PyTorch's short argument path (about 8 -> 4 us a call on CPU; two per parameter
        # and step in mixed precision)
        kwargs = {k: v for k, v in kwargs.items()
                  if k != "device" and not (k == "layout" and v == torch.strided)}
    if "device" in kwargs:
        kwargs = dict(kwargs, device=device)
    if str(node.target) in R.RANDOM_OPS and R.is_sharded(strategy.outputs[0]) \
            and not (node.target is aten.native_dropout.default and args[2:3] == [False]):
        assert coords is not None, f"localizing sharded random op {node.name} needs coords"
        call = _Call(node, list(args), dict(kwargs), strategy, tuple(mesh_shape), device)
        return R.lower_random(node, call.args, call.kwargs, call.out_shape(),
                              strategy.outputs[0], coords)
    rewrite = _REWRITES.get(str(node.target))
    if rewrite is None:
        call = node.target, args, kwargs
    else:
        call = rewrite(_Call(node, list(args), dict(kwargs), strategy, tuple(mesh_shape), device,
                             coords))
    check_op(node, call[0], torch.device(device).type)
    return call
