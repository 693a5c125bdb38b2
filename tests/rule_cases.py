"""Harness cases for the sharding rules (``test_rules.py`` runs every strategy of every op).

Each case is a small function and its example inputs. Most are traced like a training
step -- forward and backward (``fwd_bwd``) through torchalpa's decompositions -- so the
ops are the ones real graphs contain. ``keep`` names ops to trace whole instead of
decomposing: fused ops (layer-norm backward, flash attention, nll_loss...) the frontend
may keep. ``pre_dispatch`` keeps composite ops (``reshape``) that only pre-dispatch
graphs contain. ``POINTWISE_CALLS`` calls every elementwise op directly, one case each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from torchalpa.frontends import constants  # noqa: F401  (registers torchalpa::constant)
from torchalpa.ops.cross_entropy import cross_entropy
from torchalpa.ops.markers import mark_pipeline_boundary

aten = torch.ops.aten
aten_constant = torch.ops.torchalpa.constant.default


@dataclass(frozen=True)
class Case:
    fn: Callable
    args: Callable[[], tuple]
    keep: tuple = ()
    pre_dispatch: bool = False
    atol: float = 1e-4


def rnd(*shape):
    return torch.randn(*shape)


def ints(high, *shape):
    return torch.randint(0, high, shape)


def fwd_bwd(f, wrt):
    """``f``'s outputs, then the gradients of ``sum(out ** 2)`` w.r.t. the args at ``wrt``."""
    def step(*args):
        args = [a.detach().requires_grad_(i in wrt) for i, a in enumerate(args)]
        out = f(*args)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum((o * o).sum() for o in outs if o.requires_grad)
        return (*outs, *torch.autograd.grad(loss, [args[i] for i in wrt]))
    return step


def math_attention(q, k, v, causal):
    """Attention as matmuls and softmax (what unfused backends and dropout trace to)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5          # (B, H, L, S)
    if causal:
        allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(allowed.logical_not(), float("-inf"))
    return F.softmax(scores, -1) @ v


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _complex_rope(x, theta):
    """Llama 4's rotary embedding: pairs of features as complex numbers times e^(i theta)
    (plus a complex built from real and imaginary parts, for ``aten.complex``)."""
    freqs = torch.polar(torch.ones_like(theta), theta)                       # (T, D/2)
    freqs = freqs + torch.complex(theta, theta * 0.5) * 0.1                  # (T, D/2)
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))          # (B, T, D/2)
    return torch.view_as_real(pairs * freqs).flatten(-2)                    # (B, T, D)


def _moe(x, gate_w, expert_w):
    """Top-2 gating, dense dispatch/combine (GShard) and sparse dispatch by token index
    (gather the routed tokens, index_add them back), with a load-balancing loss."""
    tokens, experts = x.shape[0], gate_w.shape[1]
    probs = F.softmax(x @ gate_w, dim=-1)                        # (T, E)
    weights, chosen = torch.topk(probs, 2, dim=-1)               # (T, 2)
    mask = F.one_hot(chosen, experts).float()                    # (T, 2, E)
    aux = (mask.sum((0, 1)) / tokens * probs.mean(0)).sum() * experts
    gates = (mask * weights.unsqueeze(-1)).sum(1)                # (T, E)
    expert_in = torch.einsum("te,td->etd", mask.sum(1), x)       # (E, T, D)
    dense = torch.einsum("te,etd->td", gates, torch.bmm(expert_in, expert_w))
    token = torch.arange(tokens).repeat_interleave(2)            # (T*2,)
    routed = torch.bmm(x[token].unsqueeze(1), expert_w[chosen.reshape(-1)]).squeeze(1)
    sparse = torch.zeros_like(x).index_add(0, token, routed * weights.reshape(-1, 1))
    return dense, sparse, aux


_UNDECOMPOSED = tuple(f"aten.{op}" for op in (
    "_unsafe_view.default", "t.default", "transpose.int", "squeeze.dim", "squeeze.default",
    "sum.default", "all.default", "all.dim", "arange.default", "arange.start", "ones.default",
    "zeros.default", "ones_like.default", "zeros_like.default", "empty_like.default",
    "bernoulli.default"))
_NORM_KEEP = ("aten.native_layer_norm_backward.default",)
_BN_KEEP = ("aten.native_batch_norm_backward.default",)
_GN_KEEP = ("aten.native_group_norm_backward.default",)
_SOFTMAX_KEEP = ("aten._softmax_backward_data.default", "aten._log_softmax_backward_data.default")
_FLASH = ("aten._scaled_dot_product_flash_attention_for_cpu.default",)


def _bn(training):
    def fn(x, w, b, rm, rv):
        return F.batch_norm(x, rm, rv, w, b, training=training)
    return fwd_bwd(fn, [0, 1, 2])


def _bn_args():
    return rnd(2, 4, 3, 3), rnd(4), rnd(4), rnd(4), rnd(4).abs() + 0.5


def _upsample_every_mode(x1, x2, x3):
    """Every upsampling op the resize rules cover, forward then backward, called directly
    (core ATen decomposes some forwards into index arithmetic; the frontend may keep them)."""
    from torchalpa.passes.rules.resize import UPSAMPLES
    outs = []
    for op, spatial in UPSAMPLES.items():
        x = (x1, x2, x3)[spatial - 1]
        size = [2 * d + 1 for d in x.shape[2:]]                   # not a whole multiple
        corners = [] if "nearest" in op else [op.endswith("aa.default")]
        forward = getattr(aten, op.split(".")[1])
        backward = getattr(aten, op.split(".")[1] + "_backward")
        y = forward(x, size, *corners)
        outs += [y, backward(y * 2, size, list(x.shape), *corners)]
    return tuple(outs)


def _upsample_keep():
    from torchalpa.passes.rules.resize import UPSAMPLE_BACKWARDS, UPSAMPLES
    return tuple(UPSAMPLES) + tuple(UPSAMPLE_BACKWARDS)


def _flash(causal, mask=False):
    def fn(q, k, v, *m):
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=m[0] if m else None)
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            out * 2, q, k, v, out, lse, 0.0, causal, attn_mask=m[0] if m else None)
        return (out, lse, *grads)
    return fn


CASES: dict[str, Case] = {
    # matmul, elementwise, reductions, views (the first end-to-end path)
    "mm": Case(lambda a, b: torch.mm(a, b), lambda: (rnd(8, 4), rnd(4, 8))),
    "bmm": Case(lambda a, b: torch.bmm(a, b), lambda: (rnd(4, 4, 8), rnd(4, 8, 4))),
    "solve_triangular": Case(fwd_bwd(lambda a, b, c: (
        torch.linalg.solve_triangular(a, b, upper=False),
        torch.linalg.solve_triangular(a, c, upper=False, left=False, unitriangular=True)),
        [0, 1, 2]),
        lambda: (rnd(2, 4, 4).tril() + 4 * torch.eye(4), rnd(2, 4, 8), rnd(2, 8, 4))),
    # two or more batch dims: torchalpa::batched_matmul (forward and both gradients)
    "batched_matmul": Case(fwd_bwd(lambda a, b: a @ b, [0, 1]),
                           lambda: (rnd(2, 4, 2, 4, 8), rnd(2, 4, 2, 8, 4))),
    "linear": Case(fwd_bwd(F.linear, [0, 1, 2]), lambda: (rnd(2, 4, 4), rnd(8, 4), rnd(8))),
    "add_broadcast": Case(lambda a, b: a + b, lambda: (rnd(4, 8), rnd(8))),
    "sub_mul_div": Case(lambda a, b: (a - b) * b / 3.0, lambda: (rnd(4, 8), rnd(4, 8))),
    "where_le": Case(lambda a, b: torch.where(a <= 0, torch.zeros(()), b), lambda: (rnd(4, 8), rnd(4, 8))),
    "sum_mean": Case(lambda a: (a.sum(dim=0, keepdim=True), a.sum(), a.mean(), a.mean(dim=(0, 2))),
                     lambda: (rnd(4, 8, 4),)),
    "view_split_merge": Case(lambda a: a.view(4, 2, 8).reshape(8, 8), lambda: (rnd(8, 8),)),
    "view_general": Case(lambda a: a.reshape(4, 6), lambda: (rnd(6, 4),)),
    "view_regroup": Case(lambda a: a.reshape(4, 4, 8).relu(), lambda: (rnd(4, 8, 4),)),
    # a fused q/k/v viewed as (pieces, heads, head dim) and back: heads split as a strided
    # shard of the fused dim
    "view_pieces_heads": Case(lambda a: a.view(2, 3, 4, 2).relu().reshape(2, 24),
                              lambda: (rnd(2, 24),)),
    "reshape_composite": Case(lambda a: aten.reshape.default(a, [4, 2, 8]) * 2,
                              lambda: (rnd(8, 8),), pre_dispatch=True),
    "permute_t_transpose": Case(lambda a: a.permute(2, 0, 1).transpose(0, 1).reshape(8, 16).t(),
                                lambda: (rnd(4, 8, 4),)),
    "expand": Case(lambda a: a.expand(4, 4, 8), lambda: (rnd(4, 1, 8),)),
    "squeezes": Case(lambda a: (aten.squeeze.dim(a.unsqueeze(1), 1), aten.squeeze.default(a[:, None]),
                                a.unsqueeze(0).squeeze(0)), lambda: (rnd(4, 8),)),
    "repeat": Case(fwd_bwd(lambda a: a.repeat(3, 2, 1), [0]), lambda: (rnd(4, 4),)),
    "repeat_interleave": Case(fwd_bwd(lambda a: a.repeat_interleave(2, dim=1), [0]), lambda: (rnd(4, 4),)),
    "mse_loss": Case(fwd_bwd(F.mse_loss, [0]), lambda: (rnd(8, 4), rnd(8, 4))),
    "reductions": Case(lambda a: (
        a.amax(-1), a.amin(0, keepdim=True), a.max(1), a.min(1), a.max(), a.min(), a.argmax(-1),
        a.argmin(), (a > 0).any(-1), (a > 0).any(), aten.any.dims(a > 0, [0, 1]),
        (a > 0).all(0), (a > 0).all(), a.var(1), a.std(0), torch.var_mean(a, 1), a.prod(1),
        a.prod(), a.logsumexp(1), torch.linalg.vector_norm(a, dim=1), a.cumsum(1), a.cumprod(0)),
        lambda: (rnd(4, 8, 2),), keep=("aten.std.correction", "aten.logsumexp.default")),
    "reductions_backward": Case(fwd_bwd(lambda a: (a.amax(-1), a.var(0), a.cumsum(1), a.logsumexp(1)), [0]),
                                lambda: (rnd(4, 8),)),
    # softmax
    "softmax": Case(fwd_bwd(lambda x: F.softmax(x, -1), [0]), lambda: (rnd(4, 8),)),
    "log_softmax": Case(fwd_bwd(lambda x: F.log_softmax(x, 1), [0]), lambda: (rnd(2, 8, 4),),
                        keep=_SOFTMAX_KEEP),
    "softmax_backward_data": Case(fwd_bwd(lambda x: F.softmax(x, 0), [0]), lambda: (rnd(8, 4),),
                                  keep=_SOFTMAX_KEEP),
    "safe_softmax": Case(lambda x: aten._safe_softmax(x.masked_fill(x > 1, float("-inf")), -1),
                         lambda: (rnd(4, 8),), keep=("aten._safe_softmax.default",)),
    # norms
    "layer_norm": Case(fwd_bwd(lambda x, w, b: F.layer_norm(x, (8,), w, b), [0, 1, 2]),
                       lambda: (rnd(2, 4, 8), rnd(8), rnd(8)), keep=_NORM_KEEP),
    "layer_norm_decomposed": Case(fwd_bwd(lambda x, w, b: F.layer_norm(x, (8,), w, b), [0, 1, 2]),
                                  lambda: (rnd(4, 8), rnd(8), rnd(8))),
    "layer_norm_masked_backward": Case(lambda g, x: aten.native_layer_norm_backward(
        g, x, [4, 8], *aten.native_layer_norm(x, [4, 8], None, None, 1e-5)[1:], None, None,
        [True, False, False]), lambda: (rnd(4, 4, 8), rnd(4, 4, 8)), keep=_NORM_KEEP),
    "rms_norm": Case(fwd_bwd(lambda x, w: F.rms_norm(x, (8,), w), [0, 1]), lambda: (rnd(4, 8), rnd(8))),
    "batch_norm_train": Case(_bn(True), _bn_args, keep=_BN_KEEP),
    "batch_norm_eval": Case(_bn(False), _bn_args, keep=_BN_KEEP, atol=1e-3),
    "batch_norm_decomposed": Case(_bn(True), _bn_args, atol=1e-3),
    "batch_norm_variants": Case(lambda x, w, b, rm, rv: (
        aten._native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1, 1e-5),
        aten._native_batch_norm_legit(x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5),
        aten._native_batch_norm_legit.no_stats(x, w, b, True, 0.1, 1e-5),
        aten._native_batch_norm_legit_no_training(x, w, b, rm, rv, 0.1, 1e-5)), _bn_args),
    # group norm: 4 groups of 2 channels split by the batch and by whole groups; one group
    # (PoolFormer's GroupNorm(1, C)) over a 1-d map; the backward as the frontend keeps it
    "group_norm": Case(fwd_bwd(lambda x, w, b: F.group_norm(x, 4, w, b), [0, 1, 2]),
                       lambda: (rnd(4, 8, 3, 3), rnd(8), rnd(8)), keep=_GN_KEEP),
    "group_norm_one_group": Case(fwd_bwd(lambda x: F.group_norm(x, 1), [0]),
                                 lambda: (rnd(4, 6, 5),), keep=_GN_KEEP),
    "group_norm_weight_only": Case(fwd_bwd(lambda x, w: F.group_norm(x, 2, w), [0, 1]),
                                   lambda: (rnd(2, 4, 3), rnd(4)), atol=1e-3),
    "group_norm_masked_backward": Case(lambda g, x: aten.native_group_norm_backward(
        g, x, *aten.native_group_norm(x, None, None, 4, 8, 6, 4, 1e-5)[1:], None, 4, 8, 6, 4,
        [True, False, False]), lambda: (rnd(4, 8, 6), rnd(4, 8, 6)), keep=_GN_KEEP),
    # attention
    "attention_math": Case(fwd_bwd(lambda q, k, v: math_attention(q, k, v, True), [0, 1, 2]),
                           lambda: (rnd(2, 4, 4, 8), rnd(2, 2, 4, 8), rnd(2, 2, 4, 8)), atol=1e-3),
    "flash_attention": Case(_flash(True), lambda: (rnd(2, 4, 4, 8), rnd(2, 2, 4, 8), rnd(2, 2, 4, 8)),
                            keep=_FLASH, atol=1e-3),
    "flash_attention_noncausal": Case(_flash(False), lambda: (rnd(2, 2, 4, 8), rnd(2, 2, 6, 8),
                                                              rnd(2, 2, 6, 8)), keep=_FLASH, atol=1e-3),
    "flash_attention_mask": Case(_flash(False, mask=True), lambda: (
        rnd(2, 2, 4, 8), rnd(2, 2, 6, 8), rnd(2, 2, 6, 8), rnd(2, 1, 4, 6)), keep=_FLASH, atol=1e-3),
    # the device-neutral attention op (torchalpa::sdpa) the capture records
    "sdpa_causal_gqa": Case(fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True), [0, 1, 2]),
        lambda: (rnd(2, 4, 4, 8), rnd(2, 2, 4, 8), rnd(2, 2, 4, 8)), atol=1e-3),
    "sdpa_cross_value_dim": Case(fwd_bwd(F.scaled_dot_product_attention, [0, 1, 2]),
                                 lambda: (rnd(2, 2, 4, 8), rnd(2, 2, 6, 8), rnd(2, 2, 6, 4)),
                                 atol=1e-3),
    "sdpa_bool_mask": Case(fwd_bwd(lambda q, k, v, m: F.scaled_dot_product_attention(
        q, k, v, attn_mask=m), [0, 1, 2]), lambda: (
        rnd(2, 2, 4, 8), rnd(2, 2, 6, 8), rnd(2, 2, 6, 8), rnd(2, 1, 1, 6) > -1), atol=1e-3),
    "sdpa_learned_bias": Case(fwd_bwd(lambda q, k, v, m: F.scaled_dot_product_attention(
        q, k, v, attn_mask=m), [0, 1, 2, 3]), lambda: (
        rnd(2, 2, 4, 8), rnd(2, 2, 6, 8), rnd(2, 2, 6, 8), rnd(2, 4, 6)), atol=1e-3),
    # embedding, rotary embeddings
    "embedding": Case(fwd_bwd(lambda w, i: F.embedding(i, w), [0]), lambda: (rnd(10, 8), ints(10, 2, 4))),
    "embedding_dense_backward": Case(fwd_bwd(lambda w, i: F.embedding(i, w, padding_idx=0), [0]),
                                     lambda: (rnd(10, 4), ints(10, 2, 4)),
                                     keep=("aten.embedding_dense_backward.default",)),
    "embedding_by_freq": Case(lambda g, i: aten.embedding_dense_backward(g, i, 10, -1, True),
                              lambda: (rnd(2, 4, 4), ints(10, 2, 4)),
                              keep=("aten.embedding_dense_backward.default",)),
    # vocab-parallel: 16 rows split 2 or 4 ways, padding row 5 owned by one block, and rows
    # looked up several times (frequency scaling counts each block's own rows)
    "embedding_vocab_parallel": Case(
        fwd_bwd(lambda w, i: F.embedding(i, w, padding_idx=5, scale_grad_by_freq=True), [0]),
        lambda: (rnd(16, 4), ints(16, 3, 8)), keep=("aten.embedding_dense_backward.default",)),
    "rope": Case(fwd_bwd(_rope, [0]), lambda: (rnd(2, 4, 8), rnd(4, 8), rnd(4, 8))),
    "rope_complex": Case(fwd_bwd(_complex_rope, [0, 1]), lambda: (rnd(4, 4, 8), rnd(4, 4))),
    # Fourier transforms: FNet's token mixing (the real part of a 2-d FFT), and a real
    # round trip through rfft / irfft of another length
    "fft_mixing": Case(fwd_bwd(lambda x: torch.fft.fftn(x, dim=(1, 2)).real, [0]),
                       lambda: (rnd(4, 6, 4),)),
    "fft_real": Case(fwd_bwd(lambda x: torch.fft.irfft(torch.fft.rfft(x, dim=1), n=6, dim=1),
                             [0]), lambda: (rnd(4, 7, 2),)),
    # convolution, pooling
    "conv2d": Case(fwd_bwd(lambda x, w, b: F.conv2d(x, w, b, padding=1), [0, 1, 2]),
                   lambda: (rnd(2, 4, 6, 6), rnd(4, 4, 3, 3), rnd(4)), atol=1e-3),
    "conv2d_pointwise_grouped": Case(fwd_bwd(lambda x, w: F.conv2d(x, w, groups=2), [0, 1]),
                                     lambda: (rnd(2, 4, 4, 4), rnd(8, 2, 1, 1)), atol=1e-3),
    "conv_depthwise_1d": Case(fwd_bwd(lambda x, w, b: F.conv1d(x, w, b, padding=1, groups=4), [0, 1, 2]),
                              lambda: (rnd(2, 4, 8), rnd(4, 1, 3), rnd(4)), atol=1e-3),
    "conv_transpose2d": Case(fwd_bwd(lambda x, w: F.conv_transpose2d(x, w, stride=2), [0, 1]),
                             lambda: (rnd(2, 4, 3, 3), rnd(4, 2, 2, 2)), atol=1e-3),
    "max_pool": Case(fwd_bwd(lambda x: F.max_pool2d(x, 3, 2, 1), [0]), lambda: (rnd(2, 4, 6, 6),)),
    "avg_pool": Case(fwd_bwd(lambda x: F.avg_pool2d(x, 2), [0]), lambda: (rnd(2, 4, 4, 4),)),
    "adaptive_avg_pool": Case(fwd_bwd(lambda x: F.adaptive_avg_pool2d(x, 2), [0]),
                              lambda: (rnd(2, 4, 6, 6),)),
    # resizing: upsampling as models call it (bilinear traces whole, nearest's forward as
    # index arithmetic), every upsampling op directly, sliding windows (Tensor.unfold)
    "upsample_bilinear": Case(fwd_bwd(lambda x: F.interpolate(
        x, scale_factor=2, mode="bilinear", align_corners=False), [0]), lambda: (rnd(4, 4, 3, 5),)),
    "upsample_bilinear_to_size": Case(fwd_bwd(lambda x: F.interpolate(
        x, size=(7, 4), mode="bilinear", align_corners=True), [0]), lambda: (rnd(2, 4, 3, 3),)),
    "upsample_nearest": Case(fwd_bwd(lambda x: F.interpolate(x, scale_factor=2), [0]),
                             lambda: (rnd(4, 4, 3, 3),)),
    "upsample_every_mode": Case(_upsample_every_mode, lambda: (
        rnd(2, 4, 5), rnd(2, 4, 3, 4), rnd(2, 4, 2, 3, 2)), keep=_upsample_keep(), atol=1e-3),
    # overlapping windows of dim 1, summed (a whole-tensor view of them would be overlapping)
    "unfold_windows": Case(fwd_bwd(lambda x: x.unfold(1, 3, 2).sum(-1), [0]),
                           lambda: (rnd(4, 7, 4),)),
    # losses
    "cross_entropy": Case(fwd_bwd(lambda x, t: F.cross_entropy(x, t, ignore_index=-100), [0]),
                          lambda: (rnd(8, 6), torch.tensor([1, 2, -100, 3, 4, 5, 0, -100]))),
    # the fused op (torchalpa::cross_entropy): tokens split, the vocabulary split with its
    # statistics all-reduced (8 columns: split 2 and 4 ways, over one axis or both)
    "fused_cross_entropy": Case(lambda x, t: (
        fwd_bwd(lambda x: cross_entropy(x, t), [0])(x),
        fwd_bwd(lambda x: cross_entropy(x, t, reduction="none", label_smoothing=0.1), [0])(x)),
        lambda: (rnd(8, 8), torch.tensor([1, 2, -100, 3, 7, 5, 0, -100]))),
    "nll_loss": Case(lambda x, t, w: (
        fwd_bwd(lambda x: F.nll_loss(x, t, ignore_index=2), [0])(x),
        fwd_bwd(lambda x: F.nll_loss(x, t, w, reduction="sum"), [0])(x),
        fwd_bwd(lambda x: F.nll_loss(x, t, reduction="none"), [0])(x)),
        lambda: (rnd(8, 6).log_softmax(-1), ints(6, 8), rnd(6).abs()),
        keep=("aten.nll_loss_forward.default", "aten.nll_loss_backward.default")),
    # activations, dropout and other random ops
    "activations": Case(fwd_bwd(lambda x: (F.gelu(x), F.gelu(x, approximate="tanh"), F.silu(x),
                                           torch.tanh(x), torch.sigmoid(x), F.relu(x)), [0]),
                        lambda: (rnd(4, 8),)),
    "dropout": Case(fwd_bwd(lambda x: F.dropout(x, 0.5, training=True), [0]), lambda: (rnd(4, 8),)),
    "random": Case(lambda x: (
        torch.rand(4, 8), torch.randn(4, 8), torch.rand_like(x), torch.randn_like(x),
        torch.randint(0, 5, (4, 8)), torch.randint(5, (4, 8)), torch.randperm(8),
        torch.randint_like(x, 5), torch.randint_like(x, 1, 5), torch.bernoulli(x.sigmoid()),
        aten.bernoulli.p(x, 0.3), aten.bernoulli_.float(x.clone(), 0.3),
        aten.bernoulli_.Tensor(x.clone(), x.sigmoid()), x.clone().uniform_(), x.clone().normal_(),
        x.clone().exponential_(), aten.native_dropout(x, 0.5, True),
        aten.uniform(x, 0.5, 1.5), aten.exponential(x), aten.normal_functional(x),
        aten.native_dropout(x, 0.5, False)), lambda: (rnd(4, 8),)),
    # ordering and indexing
    "topk_sort": Case(lambda x: (torch.topk(x, 3, dim=1), torch.sort(x, 0), torch.sort(x, dim=-1, stable=True)),
                      lambda: (rnd(4, 8, 2),)),
    "gather_scatter": Case(lambda x, i, s: (
        torch.gather(x, 1, i), x.scatter(1, i, s), x.scatter(1, i, 0.0), x.scatter(1, i, 2.0),
        x.scatter_add(1, i, s), x.scatter_reduce(1, i, s, "sum"), x.scatter_reduce(1, i, s, "amax"),
        x.scatter_reduce(1, i, s, "sum", include_self=False)),
        lambda: (rnd(4, 8), ints(8, 4, 4), rnd(4, 4))),
    "gather_backward": Case(fwd_bwd(lambda x, i: torch.gather(x, 0, i), [0]), lambda: (rnd(4, 8), ints(4, 4, 8))),
    "index_select": Case(fwd_bwd(lambda x, i: x.index_select(1, i), [0]), lambda: (rnd(4, 8), ints(8, 6))),
    "index": Case(lambda x, i, j: (x[i], x[:, i], x[i, :, j], x[:, i, j[:, None]]),
                  lambda: (rnd(4, 8, 6), ints(4, 5), ints(6, 5))),
    "index_put": Case(lambda x, i, v, w: (aten.index_put(x, [i], v, True), aten.index_put(x, [i], v),
                                          aten.index_put_(x.clone(), [None, i[:3]], w, True)),
                      lambda: (rnd(6, 4), ints(4, 8), rnd(8, 4), rnd(6, 3))),
    "index_add": Case(lambda x, i, s: x.index_add(0, i, s, alpha=2), lambda: (rnd(6, 4), ints(6, 8), rnd(8, 4)),
                      keep=("aten.index_add.default",)),
    "moe": Case(fwd_bwd(_moe, [0, 1, 2]), lambda: (rnd(8, 4), rnd(4, 4), rnd(4, 4, 4)), atol=1e-3),
    # slicing and joining
    "slice_select": Case(fwd_bwd(lambda a: (a[1:3, ::2] * 2, a[:, 0], a[:, 2:], a.narrow(0, 1, 2)), [0]),
                         lambda: (rnd(4, 8),)),
    "cat_stack_split": Case(fwd_bwd(lambda a, b: (torch.cat([a, b], 1), torch.cat([a, b]),
                                                  *torch.cat([a, b], 1).split([4, 8, 4], 1)), [0, 1]),
                            lambda: (rnd(4, 8), rnd(4, 8))),
    "stack_unbind_split": Case(lambda a, b: (torch.stack([a, b], 1), *a.unbind(1), *a.split(2, 0),
                                             torch.cat([torch.zeros(0), a.reshape(-1)])),
                               lambda: (rnd(4, 8), rnd(4, 8)),
                               keep=("aten.stack.default", "aten.unbind.int", "aten.split.Tensor")),
    "scatter_backs": Case(lambda a, s, t: (aten.slice_scatter(a, s, 1, 2, 6), aten.select_scatter(a, t, 1, 3),
                                           aten.slice_scatter(a, a * 2, 0, 0, 9223372036854775807)),
                          lambda: (rnd(4, 8), rnd(4, 4), rnd(4)), keep=("aten.select_scatter.default",)),
    "flip_pad": Case(fwd_bwd(lambda a: (a.flip(1), F.pad(a, (1, 2)), F.pad(a, (0, 0, 1, 0), value=1.0)), [0]),
                     lambda: (rnd(4, 8),)),
    # factories
    "factories": Case(lambda a: (
        a + torch.full((4, 8), 2.0), torch.zeros(4, 8), torch.ones(4, 8), torch.scalar_tensor(3.0),
        torch.full_like(a, 0.0), torch.zeros_like(a), torch.ones_like(a), a.new_zeros(4, 8),
        a.new_ones(4, 2), a.new_full((2, 8), 3.0), torch.arange(8), torch.arange(2, 8),
        torch.arange(0, 8, 2), torch.empty(4, 8), torch.empty_like(a), a.new_empty(4, 8),
        aten.empty_permuted([4, 8], [1, 0]),
        # what functionalization makes of a copy into a column-major buffer
        aten.copy(aten.new_empty_strided(a, (4, 8), (1, 4)), a * 2)),
        lambda: (rnd(4, 8),),
        keep=("aten.new_zeros.default", "aten.new_ones.default", "aten.new_full.default",
              "aten.new_empty.default", "aten.new_empty_strided.default")),
    # counts per bin: a fixed range adds up over devices, the data's own range does not
    "histc": Case(lambda a: (torch.histc(a, bins=4, min=-1.0, max=1.0), torch.histc(a, bins=3)),
                  lambda: (rnd(4, 8),)),
    # a small constant a forward built from Python values (frontends/constants.py)
    "constant": Case(lambda a: (a * aten_constant([8], floats=[float(i) for i in range(8)], ints=[],
                                                  dtype=torch.float32, device=a.device),
                                aten_constant([2, 3], floats=[], ints=[1, 2, 3, 4, 5, 6], dtype=torch.int64,
                                              device=a.device)),
                     lambda: (rnd(4, 8),)),
    # the pipeline-stage marker (identity), forward and backward
    "pipeline_boundary": Case(fwd_bwd(lambda x: mark_pipeline_boundary(x * 2), [0]), lambda: (rnd(4, 8),)),
    # ops the decompositions rewrite (t -> permute, ones -> full...), kept whole
    "undecomposed": Case(lambda a: (
        aten._unsafe_view(a, [8, 4]), aten.t(a), aten.transpose(a, 0, 1), aten.squeeze.dim(a[None], 0),
        aten.squeeze.default(a[:, None]), aten.sum.default(a), aten.all.default(a > 0),
        aten.all.dim(a > 0, 1), aten.arange.default(8), aten.arange.start(2, 8), aten.ones([4, 8]),
        aten.zeros([4, 8]), aten.ones_like(a), aten.zeros_like(a), aten.empty_like(a),
        aten.bernoulli.default(a.sigmoid())), lambda: (rnd(4, 8),), keep=_UNDECOMPOSED),
}


def _pointwise(call, a=lambda: rnd(4, 8), b=lambda: rnd(8)):
    return call, lambda: (a(), b())


_POS = lambda: rnd(4, 8).abs() + 0.5   # noqa: E731
_BOOL = lambda: rnd(4, 8) > 0          # noqa: E731
_BOOL_ROW = lambda: rnd(8) > 0         # noqa: E731
_INT = lambda: ints(7, 4, 8)           # noqa: E731
_INT_ROW = lambda: ints(7, 8) + 1      # noqa: E731
_SAME = lambda: rnd(4, 8)              # noqa: E731
_UNIT = lambda: rnd(4, 8).tanh() * 0.9  # noqa: E731   inside (-1, 1)

# Every elementwise op called directly: (call(a, b), make (a, b)); b broadcasts over a.
POINTWISE_CALLS = {
    "aten.add.Tensor": _pointwise(lambda a, b: aten.add.Tensor(a, b, alpha=2)),
    "aten.sub.Tensor": _pointwise(lambda a, b: aten.sub.Tensor(a, b)),
    "aten.mul.Tensor": _pointwise(lambda a, b: aten.mul.Tensor(a, b)),
    "aten.div.Tensor": _pointwise(lambda a, b: aten.div.Tensor(a, b), b=lambda: rnd(8).abs() + 1),
    "aten.div.Tensor_mode": _pointwise(
        lambda a, b: aten.div.Tensor_mode(a, b, rounding_mode="floor")),
    "aten.add.Scalar": _pointwise(lambda a, b: aten.add.Scalar(a, 2.0)),
    "aten.sub.Scalar": _pointwise(lambda a, b: aten.sub.Scalar(a, 2.0)),
    "aten.rsub.Scalar": _pointwise(lambda a, b: aten.rsub.Scalar(a, 1.0)),
    "aten.mul.Scalar": _pointwise(lambda a, b: aten.mul.Scalar(a, 3.0)),
    "aten.div.Scalar": _pointwise(lambda a, b: aten.div.Scalar(a, 3.0)),
    "aten.add_.Tensor": _pointwise(lambda a, b: aten.add_.Tensor(a.clone(), b)),
    "aten.add_.Scalar": _pointwise(lambda a, b: aten.add_.Scalar(a.clone(), 1.0)),
    "aten.mul_.Tensor": _pointwise(lambda a, b: aten.mul_.Tensor(a.clone(), b)),
    "aten.mul_.Scalar": _pointwise(lambda a, b: aten.mul_.Scalar(a.clone(), 2.0)),
    "aten.div_.Tensor": _pointwise(
        lambda a, b: aten.div_.Tensor(a.clone(), b), b=lambda: rnd(8).abs() + 1),
    "aten.div_.Scalar": _pointwise(lambda a, b: aten.div_.Scalar(a.clone(), 2.0)),
    "aten.copy_.default": _pointwise(lambda a, b: aten.copy_.default(a.clone(), b)),
    "aten.copy.default": _pointwise(lambda a, b: aten.copy.default(a, b)),
    "aten.neg.default": _pointwise(lambda a, b: aten.neg(a)),
    "aten.alias.default": _pointwise(lambda a, b: aten.alias(a)),
    "aten.detach.default": _pointwise(lambda a, b: aten.detach(a)),
    "aten.clone.default": _pointwise(lambda a, b: aten.clone(a)),
    "aten.lift_fresh_copy.default": _pointwise(lambda a, b: aten.lift_fresh_copy(a)),
    "aten._to_copy.default": _pointwise(lambda a, b: (aten._to_copy(a, dtype=torch.float64),
                                                      aten._to_copy(a * 3, dtype=torch.int32))),
    "aten.relu.default": _pointwise(lambda a, b: aten.relu(a)),
    "aten.gelu.default": _pointwise(lambda a, b: aten.gelu(a)),
    "aten.silu.default": _pointwise(lambda a, b: aten.silu(a)),
    "aten.sigmoid.default": _pointwise(lambda a, b: aten.sigmoid(a)),
    "aten.tanh.default": _pointwise(lambda a, b: aten.tanh(a)),
    "aten.exp.default": _pointwise(lambda a, b: aten.exp(a)),
    "aten.exp2.default": _pointwise(lambda a, b: aten.exp2(a)),
    "aten.expm1.default": _pointwise(lambda a, b: aten.expm1(a)),
    "aten.log.default": _pointwise(lambda a, b: aten.log(a), a=_POS),
    "aten.log2.default": _pointwise(lambda a, b: aten.log2(a), a=_POS),
    "aten.log1p.default": _pointwise(lambda a, b: aten.log1p(a), a=_POS),
    "aten.sqrt.default": _pointwise(lambda a, b: aten.sqrt(a), a=_POS),
    "aten.rsqrt.default": _pointwise(lambda a, b: aten.rsqrt(a), a=_POS),
    "aten.reciprocal.default": _pointwise(lambda a, b: aten.reciprocal(a), a=_POS),
    "aten.abs.default": _pointwise(lambda a, b: aten.abs(a)),
    "aten.sign.default": _pointwise(lambda a, b: aten.sign(a)),
    "aten.sin.default": _pointwise(lambda a, b: aten.sin(a)),
    "aten.cos.default": _pointwise(lambda a, b: aten.cos(a)),
    "aten.erf.default": _pointwise(lambda a, b: aten.erf(a)),
    "aten.acos.default": _pointwise(lambda a, b: aten.acos(a), a=_UNIT),
    "aten.asin.default": _pointwise(lambda a, b: aten.asin(a), a=_UNIT),
    "aten.atan.default": _pointwise(lambda a, b: aten.atan(a)),
    "aten.tan.default": _pointwise(lambda a, b: aten.tan(a), a=_UNIT),
    "aten.sinh.default": _pointwise(lambda a, b: aten.sinh(a)),
    "aten.cosh.default": _pointwise(lambda a, b: aten.cosh(a)),
    "aten.log10.default": _pointwise(lambda a, b: aten.log10(a), a=_POS),
    "aten.erfinv.default": _pointwise(lambda a, b: aten.erfinv(a), a=_UNIT),
    "aten.floor.default": _pointwise(lambda a, b: aten.floor(a)),
    "aten.ceil.default": _pointwise(lambda a, b: aten.ceil(a)),
    "aten.round.default": _pointwise(lambda a, b: aten.round(a)),
    "aten.trunc.default": _pointwise(lambda a, b: aten.trunc(a)),
    "aten.square.default": _pointwise(lambda a, b: aten.square(a)),
    "aten.pow.Tensor_Scalar": _pointwise(lambda a, b: aten.pow.Tensor_Scalar(a, 2)),
    "aten.pow.Tensor_Tensor": _pointwise(lambda a, b: aten.pow.Tensor_Tensor(a, b), a=_POS),
    "aten.pow.Scalar": _pointwise(lambda a, b: aten.pow.Scalar(2.0, a)),
    "aten.maximum.default": _pointwise(lambda a, b: aten.maximum(a, b)),
    "aten.minimum.default": _pointwise(lambda a, b: aten.minimum(a, b)),
    "aten.where.self": _pointwise(lambda a, b: aten.where.self(a > 0, a, b)),
    "aten.le.Scalar": _pointwise(lambda a, b: aten.le.Scalar(a, 0)),
    "aten.lt.Scalar": _pointwise(lambda a, b: aten.lt.Scalar(a, 0)),
    "aten.ge.Scalar": _pointwise(lambda a, b: aten.ge.Scalar(a, 0)),
    "aten.gt.Scalar": _pointwise(lambda a, b: aten.gt.Scalar(a, 0)),
    "aten.eq.Scalar": _pointwise(lambda a, b: aten.eq.Scalar(a.round(), 0)),
    "aten.ne.Scalar": _pointwise(lambda a, b: aten.ne.Scalar(a.round(), 0)),
    "aten.le.Tensor": _pointwise(lambda a, b: aten.le.Tensor(a, b)),
    "aten.lt.Tensor": _pointwise(lambda a, b: aten.lt.Tensor(a, b)),
    "aten.ge.Tensor": _pointwise(lambda a, b: aten.ge.Tensor(a, b)),
    "aten.gt.Tensor": _pointwise(lambda a, b: aten.gt.Tensor(a, b)),
    "aten.eq.Tensor": _pointwise(lambda a, b: aten.eq.Tensor(a.round(), b.round())),
    "aten.ne.Tensor": _pointwise(lambda a, b: aten.ne.Tensor(a.round(), b.round())),
    "aten.logical_not.default": _pointwise(lambda a, b: aten.logical_not(a), a=_BOOL),
    "aten.logical_and.default": _pointwise(
        lambda a, b: aten.logical_and(a, b), a=_BOOL, b=_BOOL_ROW),
    "aten.logical_or.default": _pointwise(lambda a, b: aten.logical_or(a, b), a=_BOOL, b=_BOOL_ROW),
    "aten.logical_xor.default": _pointwise(
        lambda a, b: aten.logical_xor(a, b), a=_BOOL, b=_BOOL_ROW),
    "aten.bitwise_not.default": _pointwise(lambda a, b: aten.bitwise_not(a), a=_BOOL),
    "aten.bitwise_and.Tensor": _pointwise(
        lambda a, b: aten.bitwise_and.Tensor(a, b), a=_INT, b=_INT_ROW),
    "aten.bitwise_or.Tensor": _pointwise(
        lambda a, b: aten.bitwise_or.Tensor(a, b), a=_INT, b=_INT_ROW),
    "aten.isnan.default": _pointwise(lambda a, b: aten.isnan(a.log())),
    "aten.isinf.default": _pointwise(lambda a, b: aten.isinf(a.log())),
    "aten.clamp.default": _pointwise(lambda a, b: aten.clamp(a, -0.5, 0.5)),
    "aten.clamp.Tensor": _pointwise(lambda a, b: aten.clamp.Tensor(a, b, None)),
    "aten.clamp_min.default": _pointwise(lambda a, b: aten.clamp_min(a, 0.1)),
    "aten.clamp_max.default": _pointwise(lambda a, b: aten.clamp_max(a, 0.1)),
    "aten.fill.Scalar": _pointwise(lambda a, b: aten.fill.Scalar(a, 2.0)),
    "aten.masked_fill.Scalar": _pointwise(lambda a, b: (aten.masked_fill.Scalar(a, b > 0, 0.0),
                                                        aten.masked_fill.Scalar(a, b > 0, 1.0))),
    "aten.masked_fill.Tensor": _pointwise(lambda a, b: aten.masked_fill.Tensor(a, b > 0, b.sum())),
    "aten.masked_fill_.Scalar": _pointwise(
        lambda a, b: aten.masked_fill_.Scalar(a.clone(), b > 0, 0.0)),
    "aten.leaky_relu.default": _pointwise(lambda a, b: aten.leaky_relu(a, 0.1)),
    "aten.hardtanh.default": _pointwise(lambda a, b: aten.hardtanh(a, -0.5, 0.5)),
    "aten.elu.default": _pointwise(lambda a, b: aten.elu(a)),
    "aten.fmod.Scalar": _pointwise(lambda a, b: aten.fmod.Scalar(a, 0.7)),
    "aten.remainder.Scalar": _pointwise(lambda a, b: aten.remainder.Scalar(a, 0.7)),
    "aten.remainder.Tensor": _pointwise(
        lambda a, b: aten.remainder.Tensor(a, b), b=lambda: rnd(8).abs() + 1),
    "aten.threshold_backward.default": _pointwise(
        lambda a, b: aten.threshold_backward(a, b, 0), b=_SAME),
    "aten.sigmoid_backward.default": _pointwise(
        lambda a, b: aten.sigmoid_backward(a, b.sigmoid()), b=_SAME),
    "aten.tanh_backward.default": _pointwise(lambda a, b: aten.tanh_backward(a, b.tanh()), b=_SAME),
    "aten.gelu_backward.default": _pointwise(lambda a, b: aten.gelu_backward(a, b), b=_SAME),
    "aten.silu_backward.default": _pointwise(lambda a, b: aten.silu_backward(a, b), b=_SAME),
    "aten.leaky_relu_backward.default": _pointwise(
        lambda a, b: aten.leaky_relu_backward(a, b, 0.1, False), b=_SAME),
    "aten.elu_backward.default": _pointwise(
        lambda a, b: aten.elu_backward(a, 1.0, 1.0, 1.0, False, b), b=_SAME),
    "aten.hardtanh_backward.default": _pointwise(
        lambda a, b: aten.hardtanh_backward(a, b, -0.5, 0.5), b=_SAME),
    "aten.native_dropout_backward.default": _pointwise(
        lambda a, b: aten.native_dropout_backward(a, b > 0, 2.0), b=_SAME),
}

for _op, (_call, _args) in POINTWISE_CALLS.items():
    CASES[f"pointwise:{_op}"] = Case(_call, _args, keep=(_op,),
                                     pre_dispatch=_op == "aten.square.default")
