"""Datasheet figures of known GPUs, for ``Cluster.detect()`` and the GPU presets.

PyTorch can read a GPU's name and memory but not its peak arithmetic rate, so the rates
come from the vendors' datasheets: dense (no structured sparsity) tensor-core flop/s for
bf16/fp16 and tf32, plain fp32 (CUDA cores: what an fp32 matmul reaches while
``torch.backends.cuda.matmul.allow_tf32`` is off, PyTorch's default), memory bandwidth and
the per-GPU NVLink (or PCIe) bandwidth within a node. ``lookup(name)`` matches the name
``torch.cuda.get_device_name()`` reports ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB",
"Tesla V100-SXM2-16GB", ...); the first pattern that matches wins, so variants come
before the family name.

The cost model assumes a large matmul reaches ``MATMUL_EFFICIENCY`` of the peak (what
cuBLAS reaches on big GEMMs, and what the hand-written presets assumed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["GpuSpec", "KNOWN_GPUS", "lookup", "MATMUL_EFFICIENCY", "KERNEL_LAUNCH_S"]

T = 1e12
GB = 1e9
MATMUL_EFFICIENCY = 0.6
"""Fraction of the datasheet peak a large matmul reaches."""
KERNEL_LAUNCH_S = 5e-6
"""Time one kernel launch costs on a GPU (launch + scheduling gap, eager PyTorch)."""


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU model's datasheet figures (per device, dense)."""

    name: str
    fp32: float                 # flop/s, CUDA cores
    tf32: float                 # flop/s, tensor cores (fp32 matmuls with TF32 allowed)
    bf16: float                 # flop/s, tensor cores, fp32 accumulation (fp16 the same)
    memory_bandwidth: float     # bytes/s
    link_bandwidth: float       # bytes/s per GPU to the others of its node
    memory: float               # bytes on the card (the largest variant)


# (regex on the reported name, spec); variants first
KNOWN_GPUS: tuple[tuple[str, GpuSpec], ...] = (
    (r"H100.*PCIe", GpuSpec("H100 PCIe", 51 * T, 378 * T, 756 * T, 2.0e12, 64 * GB, 80 * GB)),
    (r"H100.*NVL", GpuSpec("H100 NVL", 60 * T, 418 * T, 835 * T, 3.9e12, 300 * GB, 94 * GB)),
    (r"H100|H800", GpuSpec("H100 SXM", 67 * T, 495 * T, 989 * T, 3.35e12, 450 * GB, 80 * GB)),
    (r"H200|GH200", GpuSpec("H200", 67 * T, 495 * T, 989 * T, 4.8e12, 450 * GB, 141 * GB)),
    (r"B200", GpuSpec("B200", 80 * T, 1100 * T, 2250 * T, 8.0e12, 900 * GB, 192 * GB)),
    (r"A100.*80GB.*PCIe|A100.*PCIe.*80GB",
     GpuSpec("A100 80GB PCIe", 19.5 * T, 156 * T, 312 * T, 1.94e12, 32 * GB, 80 * GB)),
    (r"A100.*80GB", GpuSpec("A100 80GB", 19.5 * T, 156 * T, 312 * T, 2.04e12, 300 * GB, 80 * GB)),
    (r"A100.*PCIE|A100.*PCIe",
     GpuSpec("A100 40GB PCIe", 19.5 * T, 156 * T, 312 * T, 1.56e12, 32 * GB, 40 * GB)),
    (r"A100|A800", GpuSpec("A100 40GB", 19.5 * T, 156 * T, 312 * T, 1.56e12, 300 * GB, 40 * GB)),
    (r"L40S", GpuSpec("L40S", 91.6 * T, 183 * T, 362 * T, 0.864e12, 32 * GB, 48 * GB)),
    (r"\bL40\b", GpuSpec("L40", 90.5 * T, 90.5 * T, 181 * T, 0.864e12, 32 * GB, 48 * GB)),
    (r"\bL4\b", GpuSpec("L4", 30.3 * T, 60 * T, 121 * T, 0.3e12, 32 * GB, 24 * GB)),
    (r"\bA10G\b", GpuSpec("A10G", 31.2 * T, 35 * T, 70 * T, 0.6e12, 16 * GB, 24 * GB)),
    (r"\bA10\b", GpuSpec("A10", 31.2 * T, 62.5 * T, 125 * T, 0.6e12, 32 * GB, 24 * GB)),
    # V100 and T4 have no tf32 and no bf16 tensor cores: bf16 runs at about the fp32 rate
    (r"V100", GpuSpec("V100", 15.7 * T, 15.7 * T, 15.7 * T, 0.9e12, 150 * GB, 32 * GB)),
    (r"\bT4\b", GpuSpec("T4", 8.1 * T, 8.1 * T, 8.1 * T, 0.32e12, 16 * GB, 16 * GB)),
    (r"RTX 4090", GpuSpec("RTX 4090", 82.6 * T, 82.6 * T, 165 * T, 1.0e12, 32 * GB, 24 * GB)),
    (r"RTX 3090", GpuSpec("RTX 3090", 35.6 * T, 35.6 * T, 71 * T, 0.94e12, 32 * GB, 24 * GB)),
)
FP16_TENSOR_CORES = {"V100": 125 * T, "T4": 65 * T}
"""GPUs whose fp16 tensor cores are faster than their bf16 path (which they lack)."""


def lookup(device_name: str) -> GpuSpec | None:
    """The spec of the GPU called ``device_name``, or None for an unknown one."""
    for pattern, spec in KNOWN_GPUS:
        if re.search(pattern, device_name):
            return spec
    return None


def peaks_by_dtype(spec: GpuSpec, *, allow_tf32: bool) -> tuple[tuple[str, float], ...]:
    """Reachable matmul flop/s per dtype (``MATMUL_EFFICIENCY`` of the datasheet peaks).

    float32 matmuls use tensor cores only when TF32 is allowed
    (``torch.set_float32_matmul_precision("high")``)."""
    fp32 = spec.tf32 if allow_tf32 else spec.fp32
    fp16 = FP16_TENSOR_CORES.get(spec.name, spec.bf16)
    return tuple((dtype, peak * MATMUL_EFFICIENCY) for dtype, peak in (
        ("float32", fp32), ("bfloat16", spec.bf16), ("float16", fp16)))
