"""Ops that run only on some device types, and the check that a program has none foreign.

A program is traced on one device type (``meta``, CPU, a fake ``cuda``) and may run on
another; an op whose kernel exists for the tracing device only then fails at the first
step on the real one (``aten._scaled_dot_product_flash_attention_for_cpu`` on an H100).
CPU-only CI must catch that before a GPU ever sees the program, so the lowering asks, for
every op it emits, whether it can run on the target device type:

- by name, for kernels that belong to one family of devices: ``*_for_cpu``, mkldnn, MKL and
  fbgemm ops run on CPU only; cuDNN, MIOpen, cuFFT and the fused flash / memory-efficient
  attention kernels on CUDA (and ROCm, which PyTorch also calls ``cuda``) only;
- by the dispatcher, where this build can know: an ATen op with neither a kernel for the
  target's dispatch key nor a composite kernel has nothing to run there. A CPU-only build
  registers no CUDA kernels at all, so for ``cuda`` this part applies only to CUDA builds.

Python callables (the runtime's collectives) and ops of other namespaces with composite
kernels (``torchalpa::sdpa``, functional collectives) pass.
"""

from __future__ import annotations

import functools

import torch
from torch._ops import OpOverload

__all__ = ["DeviceOpError", "runs_on", "check_op"]

# (text in the op name, the device types whose kernels it names); first match wins
_NAMED_FOR = (
    ("_for_cpu", ("cpu",)),
    ("mkldnn", ("cpu",)),
    ("_mkl_", ("cpu",)),
    ("fbgemm", ("cpu",)),
    ("cudnn", ("cuda",)),
    ("miopen", ("cuda",)),
    ("cufft", ("cuda",)),
    ("_flash_attention", ("cuda",)),
    ("_efficient_attention", ("cuda",)),
)
_DISPATCH_KEY = {"cpu": "CPU", "cuda": "CUDA"}
_COMPOSITE_KEYS = ("CompositeExplicitAutograd", "CompositeImplicitAutograd",
                   "CompositeExplicitAutogradNonFunctional")


class DeviceOpError(RuntimeError):
    """A program holds an op that has no kernel for the device type it is to run on."""


def _name(op) -> str:
    return str(op) if isinstance(op, OpOverload) else getattr(op, "__name__", str(op))


@functools.cache
def runs_on(op, device_type: str) -> tuple[bool, str]:
    """(whether ``op`` can run on ``device_type``, why not)."""
    if not isinstance(op, OpOverload) or device_type == "meta":
        return True, ""
    name = str(op)
    for text, devices in _NAMED_FOR:
        if text in name:
            if device_type in devices:
                return True, ""
            return False, f"a kernel for {' and '.join(devices)} only"
    key = _DISPATCH_KEY.get(device_type)
    if key is None or (device_type == "cuda" and not torch.backends.cuda.is_built()):
        return True, ""                      # this build cannot tell
    qualified = op.name()
    if any(torch._C._dispatch_has_kernel_for_dispatch_key(qualified, k)
           for k in (key, *_COMPOSITE_KEYS)):
        return True, ""
    return False, f"no {key} kernel in this PyTorch build"


def check_op(node: torch.fx.Node, target, device_type: str) -> None:
    """Raise ``DeviceOpError`` if ``target`` (the op fx ``node`` lowers to) cannot run on
    ``device_type``; the message names the op, where the model made it, and the fix."""
    ok, why = runs_on(target, device_type)
    if ok:
        return
    module = (node.meta.get("custom") or {}).get("torchalpa_module")
    line = node.meta.get("stack_trace")
    where = "".join([f" in module '{module}'" if module else "",
                     f" at {line.strip().splitlines()[-1]}" if line else ""])
    raise DeviceOpError(
        f"the program for {device_type} calls {_name(target)} (node '{node.name}'{where}), "
        f"which has {why}: the graph was traced with a kernel chosen for another device "
        f"type. Capture the step with torchalpa.auto_parallel / torchalpa.plan (they record "
        f"attention as the device-neutral torchalpa::sdpa), or trace it on the device type "
        f"it will run on.")
