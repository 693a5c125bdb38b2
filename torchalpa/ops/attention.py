"""``torchalpa::sdpa``: scaled dot-product attention as one device-neutral op.

The capture traces on fake tensors of one device type (``meta``, CPU, or fake ``cuda``)
and the program runs later on another. ``F.scaled_dot_product_attention`` picks its
kernel when it is called, so a trace that goes through it bakes in the kernel of the
trace's device (``aten._scaled_dot_product_flash_attention_for_cpu`` on CPU, which has no
CUDA kernel and no gradient for ``attn_mask``). The capture therefore records attention
as these custom ops, whose bodies call ``F.scaled_dot_product_attention`` when the
program runs, so PyTorch chooses the kernel for the tensors it is then given (flash or
memory-efficient on CUDA, the fused CPU kernel on CPU, the math path where a fused kernel
does not apply):

- ``torchalpa::sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa) -> out``
  ``q (B, Hq, L, E)``, ``k (B, Hk, S, E)``, ``v (B, Hk, S, Ev)`` -> ``out (B, Hq, L, Ev)``;
- ``torchalpa::sdpa_backward(grad_out, query, key, value, attn_mask, is_causal, scale,
  enable_gqa) -> (grad_query, grad_key, grad_value)``;
- ``torchalpa::sdpa_bias_backward(...)`` the same plus ``grad_attn_mask``, used when the
  additive mask requires a gradient (a learned attention bias: T5, ALiBi-style slopes).

The backward recomputes the attention forward under autograd and differentiates it (the
fused kernels' saved statistics differ by backend and cannot be named device-neutrally).
That costs one more attention forward in backward, which ``ATTENTION_RECOMPUTE`` tells
the flop count. Eager autograd picks the kernel as it would for the user's own code
(on CPU a mask that needs a gradient takes the math path, as in eager PyTorch).

When the program runs on CPU, the lowering saves what the fused kernel's backward needs
instead (``runtime/rewrites/attention_statistics.py``): the forward calls ``sdpa_forward_saving``, which
returns the output and the kernel's log-sum-exp of each query row, and the backward calls
``sdpa_backward_saved`` with both, so it does not run the forward again (as eager
autograd does not). Where the CPU kernel does not apply (grouped-query heads, a mask of
another dtype, another device) the forward saves an empty statistic and the backward
recomputes as above. ``ATTENTION_RECOMPUTE`` describes the captured op, not this lowering.

Dropout inside attention is not one of these ops: the capture writes it out as matmuls,
softmax and ``native_dropout`` (``frontends/opset.py``), so the random draw stays visible.
Outputs have fixed layouts (``out`` in the ``(B, L, H, Ev)`` memory order fused kernels
produce, gradients like their inputs), so ``torch.compile`` can trust the fake shapes.
"""

from __future__ import annotations

import contextlib
from typing import cast

import torch
import torch.nn.functional as F

# torch's own function, bound at import: the capture reroutes the module attribute while it
# traces (frontends/opset.py::routed_sdpa), and these bodies must reach the real kernels
_TORCH_SDPA = F.scaled_dot_product_attention

__all__ = ["sdpa", "SDPA_OP", "SDPA_BACKWARD_OP", "SDPA_BIAS_BACKWARD_OP",
           "ATTENTION_RECOMPUTE", "sdpa_forward_saving", "sdpa_backward_saved"]

SDPA_OP = "torchalpa.sdpa.default"
SDPA_BACKWARD_OP = "torchalpa.sdpa_backward.default"
SDPA_BIAS_BACKWARD_OP = "torchalpa.sdpa_bias_backward.default"
ATTENTION_RECOMPUTE = True   # the backward runs the forward again (see the module doc)


def _out_strides(query: torch.Tensor, value: torch.Tensor) -> tuple[tuple, tuple]:
    """Shape and strides of the output: (B, Hq, L, Ev) laid out as (B, L, Hq, Ev) as the
    fused kernels write it; other ranks contiguous."""
    shape = (*query.shape[:-1], value.shape[-1])
    if len(shape) != 4:
        return shape, torch.empty(shape, device="meta").stride()
    _, heads, length, ev = shape
    return shape, (length * heads * ev, ev, heads * ev, 1)


def _like_strides(ref: torch.Tensor) -> tuple:
    """The strides ``torch.empty_like(ref)`` gives (ref's own when dense)."""
    return torch.empty_like(ref, device="meta").stride()


def _restride(t: torch.Tensor, shape, strides) -> torch.Tensor:
    """``t`` with exactly ``strides`` (a copy only when its layout differs)."""
    if tuple(t.stride()) == tuple(strides) or t.numel() <= 1:
        return t
    out = torch.empty_strided(shape, strides, dtype=t.dtype, device=t.device)
    return out.copy_(t)


@torch.library.custom_op("torchalpa::sdpa", mutates_args=())
def _sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attn_mask: torch.Tensor | None, is_causal: bool, scale: float | None,
          enable_gqa: bool) -> torch.Tensor:
    out = _TORCH_SDPA(query, key, value, attn_mask=attn_mask,
                                         is_causal=is_causal, scale=scale,
                                         enable_gqa=enable_gqa)
    return _restride(out, *_out_strides(query, value))


@_sdpa.register_fake
def _(query, key, value, attn_mask, is_causal, scale, enable_gqa):
    shape, strides = _out_strides(query, value)
    return query.new_empty_strided(shape, strides)


_AUTOGRAD_KEYS = tuple(getattr(torch._C.DispatchKey, name) for name in (
    "AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView")
    if hasattr(torch._C.DispatchKey, name))


@contextlib.contextmanager
def _autograd_recording():
    """Record autograd again inside a custom op's body.

    The body runs below the Autograd dispatch keys (excluded in this thread), where
    ``torch.autograd.grad`` sees no graph. ``torch.func.vjp`` would re-enable it, but its
    wrapper tensors break under dispatch modes (collective counting, LocalTensorMode).
    """
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def _grads(grad_out, query, key, value, attn_mask, is_causal, scale, enable_gqa,
           mask_grad: bool) -> tuple[torch.Tensor, ...]:
    """Gradients of attention: recompute it under autograd and differentiate."""
    primals = (query, key, value, attn_mask) if mask_grad else (query, key, value)
    with _autograd_recording():
        leaves = [t.detach().requires_grad_(True) for t in primals]
        mask = leaves[3] if mask_grad else attn_mask
        out = _TORCH_SDPA(*leaves[:3], attn_mask=mask, is_causal=is_causal,
                                             scale=scale, enable_gqa=enable_gqa)
        grads = torch.autograd.grad(out, leaves, grad_out)
    return tuple(_restride(g, ref.shape, _like_strides(ref)) for g, ref in zip(grads, primals))


def _fake_grads(query, key, value, attn_mask, mask_grad):
    refs = (query, key, value, attn_mask) if mask_grad else (query, key, value)
    return tuple(torch.empty_like(r) for r in refs)


@torch.library.custom_op("torchalpa::sdpa_backward", mutates_args=())
def _sdpa_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
                   scale: float | None, enable_gqa: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                _grads(grad_out, query, key, value, attn_mask, is_causal, scale, enable_gqa, False))


@_sdpa_backward.register_fake
def _(grad_out, query, key, value, attn_mask, is_causal, scale, enable_gqa):
    return _fake_grads(query, key, value, attn_mask, False)


@torch.library.custom_op("torchalpa::sdpa_bias_backward", mutates_args=())
def _sdpa_bias_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attn_mask: torch.Tensor, is_causal: bool,
                        scale: float | None, enable_gqa: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return cast(tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                _grads(grad_out, query, key, value, attn_mask, is_causal, scale, enable_gqa, True))


@_sdpa_bias_backward.register_fake
def _(grad_out, query, key, value, attn_mask, is_causal, scale, enable_gqa):
    return _fake_grads(query, key, value, attn_mask, True)


def _setup_context(ctx, inputs, output):
    query, key, value, attn_mask, is_causal, scale, enable_gqa = inputs
    ctx.save_for_backward(query, key, value, attn_mask)
    ctx.options = (is_causal, scale, enable_gqa)


def _backward(ctx, grad_out):
    query, key, value, attn_mask = ctx.saved_tensors
    mask_grad = attn_mask is not None and ctx.needs_input_grad[3]
    if mask_grad:
        grads = _sdpa_bias_backward(grad_out, query, key, value, attn_mask, *ctx.options)
    else:
        grads = (*_sdpa_backward(grad_out, query, key, value, attn_mask, *ctx.options), None)
    return (*grads, None, None, None)


_sdpa.register_autograd(_backward, setup_context=_setup_context)


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
         attn_mask: torch.Tensor | None = None, is_causal: bool = False,
         scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` without dropout, as the op ``torchalpa::sdpa``."""
    if enable_gqa and key.shape[-3] == query.shape[-3]:
        enable_gqa = False                   # the same call: one spelling in the graph
    return _sdpa(query, key, value, attn_mask, bool(is_causal),
                 None if scale is None else float(scale), bool(enable_gqa))


# -- run time on CPU: the forward's statistics saved for backward (runtime/rewrites/attention_statistics.py)

_aten = torch.ops.aten
_CPU_FLASH_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _cpu_flash_mask(query: torch.Tensor, key: torch.Tensor,
                    attn_mask: torch.Tensor | None) -> tuple[bool, torch.Tensor | None]:
    """Whether the fused CPU kernel computes this call, and the additive mask it takes
    (a boolean mask becomes 0 / -inf, as ``F.scaled_dot_product_attention`` converts it)."""
    if query.device.type != "cpu" or query.dim() != 4 or query.dtype not in _CPU_FLASH_DTYPES \
            or key.shape[-3] != query.shape[-3]:
        return False, None
    if attn_mask is None or attn_mask.dtype == query.dtype:
        return True, attn_mask
    if attn_mask.dtype == torch.bool:
        additive = torch.zeros_like(attn_mask, dtype=query.dtype)
        return True, additive.masked_fill_(attn_mask.logical_not(), float("-inf"))
    return False, None


def sdpa_forward_saving(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: torch.Tensor | None, is_causal: bool,
                        scale: float | None, enable_gqa: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``torchalpa::sdpa``'s output and the statistic its backward needs: the fused CPU
    kernel's log-sum-exp per query row ``(B, Hq, L)``, or an empty tensor where that
    kernel does not apply (then ``sdpa_backward_saved`` recomputes)."""
    fused, mask = _cpu_flash_mask(query, key, attn_mask)
    if not fused:
        out = _sdpa(query, key, value, attn_mask, is_causal, scale, enable_gqa)
        return out, query.new_empty((0,), dtype=torch.float32)
    out, logsumexp = _aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=mask, scale=scale)
    return _restride(out, *_out_strides(query, value)), logsumexp


def sdpa_backward_saved(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attn_mask: torch.Tensor | None,
                        out: torch.Tensor, logsumexp: torch.Tensor, is_causal: bool,
                        scale: float | None, enable_gqa: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``torchalpa::sdpa_backward`` from the forward's ``out`` and ``logsumexp``
    (``sdpa_forward_saving``): the fused CPU kernel's backward, no recompute. An empty
    ``logsumexp`` (the kernel did not run in forward): the recomputing backward."""
    if logsumexp.numel() == 0:
        return _sdpa_backward(grad_out, query, key, value, attn_mask, is_causal, scale,
                              enable_gqa)
    _, mask = _cpu_flash_mask(query, key, attn_mask)
    grads = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal, attn_mask=mask,
        scale=scale)
    dq, dk, dv = (_restride(g, ref.shape, _like_strides(ref))
                  for g, ref in zip(grads, (query, key, value)))
    return dq, dk, dv
