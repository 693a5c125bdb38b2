"""A GPU's measured rates, stored per device, and how the planner plans with them.

``torchalpa calibrate`` (``calibrate_cuda.measure_device``) times this machine's GPU: matmul
flop/s per dtype and shape class, memory bandwidth, the host time to issue one op, and the
fused attention kernels. The datasheet figures of ``gpu_specs`` (times the efficiencies
``Cluster.preset`` applies) are what the planner assumes without a profile; a profile
replaces them with what this device reached:

- ``peak_flops_by_dtype``: each dtype's rate on the ``"large"`` shape class (a matmul that
  fills every SM for many waves: what ``MATMUL_EFFICIENCY`` stands for);
- ``memory_bandwidth``: a large copy's bytes (read + write) per second;
- ``kernel_launch_s``: seconds per op of a stream of tiny ops (the host issue cost);
- ``op_rate_factors["sdpa"]``: fused attention's flop/s over the bf16 ``"large"`` rate.

The other shape classes are kept for ``benchmarks/one_gpu.py`` and for checking
``passes/pricing/kernel_model.py`` against the device. Profiles live in the plan cache's directory
(``calibration/``), one JSON file per device name and torch version.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from torchalpa.core.cluster import Cluster
from torchalpa.parallel.cache import usable_root

__all__ = ["DeviceProfile", "MATMUL_SHAPES", "ATTENTION_SHAPE", "profile_path", "save_profile",
           "load_profile", "apply_profile", "matmul_flops", "attention_flops"]

log = logging.getLogger("torchalpa")

VERSION = 1
MATMUL_SHAPES: dict[str, tuple[int, int, int]] = {
    "large": (8192, 8192, 8192),
    "narrow": (16384, 768, 768),      # GPT-2 small's projections: few columns, short K
    "short_k": (8192, 8192, 256),
    "tp_slice": (2048, 1536, 6144),   # one micro-batch's row-parallel slice under 8-way TP
}
"""(M, N, K) of each matmul shape class timed."""
ATTENTION_SHAPE = (4, 16, 2048, 128)
"""(batch, heads, sequence, head dim) of the causal attention timed, forward + backward."""


def matmul_flops(m: int, n: int, k: int) -> float:
    return 2.0 * m * n * k


def attention_flops(batch: int, heads: int, seq: int, dim: int) -> float:
    """Flops the cost model prices for one attention forward and backward on CUDA (torch's
    flop counter, which ignores a causal mask, as the capture records them): the forward's
    two products, and a backward that runs the forward again (two), its four products and
    ``q k^T`` once more (``passes/pricing/attention_price.py``): nine products of ``2 b h s s d``.
    A measured rate over these flops is what the cost model must divide them by."""
    return 9 * 2.0 * batch * heads * seq * seq * dim


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """What one GPU reached (flop/s, bytes/s, seconds), and what it was measured on."""

    device_name: str
    torch_version: str
    matmul: dict[str, dict[str, float]]
    """dtype -> shape class -> flop/s."""
    memory_bandwidth: float
    op_s: float
    attention: dict[str, float] = field(default_factory=dict)
    """dtype -> priced flop/s of causal attention forward + backward (``attention_flops``
    over the time they took)."""
    version: int = VERSION

    def __post_init__(self):
        for dtype, rates in self.matmul.items():
            if "large" not in rates:
                raise ValueError(f"DeviceProfile.matmul[{dtype!r}] has no 'large' rate")
            for shape, rate in rates.items():
                if not rate > 0:
                    raise ValueError(f"DeviceProfile.matmul[{dtype!r}][{shape!r}] must be > 0, "
                                     f"got {rate}")
        for name in ("memory_bandwidth", "op_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DeviceProfile.{name} must be > 0, got {getattr(self, name)}")

    def to_json(self) -> str:
        return json.dumps({"version": self.version, "device_name": self.device_name,
                           "torch_version": self.torch_version, "matmul": self.matmul,
                           "memory_bandwidth": self.memory_bandwidth, "op_s": self.op_s,
                           "attention": self.attention}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DeviceProfile:
        data = json.loads(text)
        if data.get("version") != VERSION:
            raise ValueError(f"device profile version {data.get('version')!r}, this torchalpa "
                             f"reads version {VERSION}: run `torchalpa calibrate` again")
        return cls(device_name=str(data["device_name"]),
                   torch_version=str(data["torch_version"]),
                   matmul={d: {k: float(v) for k, v in r.items()}
                           for d, r in data["matmul"].items()},
                   memory_bandwidth=float(data["memory_bandwidth"]), op_s=float(data["op_s"]),
                   attention={d: float(v) for d, v in data.get("attention", {}).items()})


def profile_path(device_name: str, torch_version: str, root: Path | None = None) -> Path | None:
    """Where the profile of ``device_name`` under ``torch_version`` lives (None when the
    cache directory is unusable)."""
    root = root if root is not None else usable_root(create=True)
    if root is None:
        return None
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", f"{device_name}-torch{torch_version}").strip("-")
    return root / "calibration" / f"gpu-{slug}-v{VERSION}.json"


def save_profile(profile: DeviceProfile, root: Path | None = None) -> Path | None:
    """Store ``profile`` (private, atomically); its path, or None without a cache directory."""
    path = profile_path(profile.device_name, profile.torch_version, root)
    if path is None:
        return None
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(profile.to_json())
    os.replace(tmp, path)
    return path


def load_profile(device_name: str, torch_version: str, root: Path | None = None
                 ) -> DeviceProfile | None:
    """The stored profile of this device and torch, or None (none stored, or unreadable:
    logged, and planning goes on with the datasheet figures)."""
    path = profile_path(device_name, torch_version, root)
    if path is None or not path.is_file() or path.is_symlink():
        return None
    try:
        profile = DeviceProfile.from_json(path.read_text())
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("ignoring the unreadable device profile %s (%s)", path, e)
        return None
    if profile.device_name != device_name:
        return None
    return profile


def apply_profile(cluster: Cluster, profile: DeviceProfile, *, allow_tf32: bool = False
                  ) -> Cluster:
    """``cluster`` with the rates ``profile`` measured in place of the datasheet's (module
    doc; float32 at the "tf32" rate when ``allow_tf32``); links, memory and layout are left
    as they are."""
    peaks = dict(cluster.peak_flops_by_dtype)
    for dtype, rates in profile.matmul.items():
        if dtype == "tf32" and "tf32" in peaks:      # float32 convolutions' rate
            peaks["tf32"] = rates["large"]
        if dtype in ("float32", "tf32") and (dtype == "tf32") != allow_tf32:
            continue
        peaks["float32" if dtype == "tf32" else dtype] = rates["large"]
    factors = dict(cluster.op_rate_factors)
    base = peaks.get("bfloat16")
    if "bfloat16" in profile.attention and base:
        factors["sdpa"] = min(1.0, profile.attention["bfloat16"] / base)
    return replace(cluster, peak_flops_by_dtype=tuple(peaks.items()),
                   peak_flops=peaks.get("bfloat16", cluster.peak_flops),
                   memory_bandwidth=profile.memory_bandwidth, kernel_launch_s=profile.op_s,
                   op_rate_factors=tuple(factors.items()),
                   name=f"{cluster.name}, calibrated")
