"""Clusters and logical meshes: the hardware the planner plans for.

A ``Cluster`` describes real or virtual hardware (nodes x devices, memory, flops,
bandwidths). ``Cluster.logical_mesh(shape)`` views its devices as a 1D or 2D logical mesh,
as Alpa's ``get_logical_mesh`` does, giving each mesh axis its own latency (alpha, s) and
inverse bandwidth (beta, s/byte): an axis whose devices share a node talks over the fast
intra-node link, an axis that crosses nodes over the network. ``LogicalMesh`` is what the
cost model reads; tests can build one directly (e.g. Alpa's alpha = beta = 1).

``Cluster.detect()`` describes the hardware this process runs on: the GPU's name, the
memory its caching allocator can use, peak flop/s per dtype from a table of known GPUs
(``torchalpa/core/gpu_specs.py``), the node and device counts torchrun gives (``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``), and NCCL; without CUDA it is ``local_cpu``. ``measure_cluster()``
times the CPU machine a gloo process group runs on instead of guessing.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

__all__ = ["Cluster", "LogicalMesh"]

GB = 1e9
GRADIENT_BUCKET_BYTES = 25 * 2 ** 20
"""DDP's bucket size, the runtime's default (``runtime.buckets.DEFAULT_BUCKET_BYTES``)."""


DEVICE_ENV = "TORCHALPA_DEVICE"
"""``cpu`` or ``cuda``: what the job runs on when it should not be guessed from the machine
(unset: CUDA wherever ``torch.cuda.is_available()``). ``cpu`` runs ranks on CPUs over gloo
on a GPU machine -- several CPU ranks beside one GPU, as the test suite does."""


def cuda_selected() -> bool:
    """Whether this job runs on CUDA devices (NCCL) rather than CPUs (gloo):
    ``TORCHALPA_DEVICE`` if set, else whether CUDA is available."""
    import torch
    choice = os.environ.get(DEVICE_ENV, "").strip().lower()
    if choice in ("", "auto"):
        return torch.cuda.is_available()
    if choice == "cpu":
        return False
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"{DEVICE_ENV}=cuda, but torch.cuda.is_available() is False "
                               f"(PyTorch {torch.__version__}): install a CUDA build of PyTorch "
                               f"on a GPU machine, or unset {DEVICE_ENV} to run on CPUs")
        return True
    raise ValueError(f"{DEVICE_ENV} must be 'cpu' or 'cuda' (or unset), got {choice!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LogicalMesh:
    """A logical device mesh with per-axis communication costs and per-device compute."""

    shape: tuple[int, ...]
    alpha: tuple[float, ...] | None = None
    """Latency per collective on each axis, seconds (default 1.0 each, Alpa's unit costs)."""
    beta: tuple[float, ...] | None = None
    """Seconds per byte on each axis (default 1.0 each)."""
    axis_names: tuple[str, ...] | None = None
    peak_flops: float | None = None
    """Per-device flop/s; None leaves compute out of the cost (Alpa's communication-only
    setting, where matmuls are always fully sharded)."""
    memory_bandwidth: float | None = None
    """Per-device bytes/s for the roofline of memory-bound ops."""
    memory_per_device: float | None = None
    """Bytes each device may hold; None means no budget."""
    backend: str = "nccl"
    """Collective library: 'gloo' implements reduce-scatter as an all-reduce (measured by
    benchmarks/collective_bytes.py), so it costs as much."""
    peak_flops_by_dtype: tuple[tuple[str, float], ...] = ()
    """Per-device flop/s of ops computing in a dtype ("bfloat16", "float32", ...); a dtype
    not listed uses ``peak_flops``."""
    kernel_launch_s: float = 0.0
    """Time every op pays to launch, whatever its size (GPU kernel launch latency)."""
    device_name: str = ""
    """The device planned for ("NVIDIA H100 80GB HBM3"), for the plan's summary."""
    gradient_bucket_bytes: float = 0.0
    """Bytes per bucket the runtime packs gradient reductions into, one latency each: a
    gradient's all-reduce pays the latency of its share of a bucket. 0: each gradient's
    collective pays a whole latency (Alpa's accounting, and these tests' default)."""
    peak_flops_by_op: tuple[tuple[str, float], ...] = ()
    """Per-device flop/s of op families that run far from the matmul peak, by family
    (``passes/cost.py::op_family``: "convolution" covers its backward too); a family not
    listed uses the dtype's peak."""
    optimizer_tensor_s: float = 0.0
    """Seconds the optimizer's step pays per parameter tensor whatever its size (its loop
    and element-wise launches; ``measure_cluster()`` times Adam). 0 leaves the optimizer
    out of the step's estimate (Alpa's accounting, and the presets')."""

    def __post_init__(self):
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"LogicalMesh.backend must be 'nccl' or 'gloo', got {self.backend!r}")
        _check_non_negative(self, "LogicalMesh", ("kernel_launch_s", "optimizer_tensor_s",
                                               "gradient_bucket_bytes"))
        object.__setattr__(self, "peak_flops_by_dtype", _dtype_peaks(self.peak_flops_by_dtype,
                                                                     "LogicalMesh"))
        object.__setattr__(self, "peak_flops_by_op", _dtype_peaks(
            self.peak_flops_by_op, "LogicalMesh", "peak_flops_by_op"))
        shape = tuple(int(s) for s in self.shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"LogicalMesh.shape must be positive ints, got {self.shape}")
        if len(shape) > 2:
            raise ValueError(f"LogicalMesh supports 1D and 2D meshes, got shape {shape}")
        object.__setattr__(self, "shape", shape)
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            value = (1.0,) * len(shape) if value is None else tuple(float(v) for v in value)
            if len(value) != len(shape):
                raise ValueError(f"LogicalMesh.{name} needs one value per mesh axis "
                                 f"({len(shape)}), got {value}")
            object.__setattr__(self, name, value)
        names = self.axis_names or tuple(f"axis{i}" for i in range(len(shape)))
        if len(names) != len(shape):
            raise ValueError(f"LogicalMesh.axis_names needs {len(shape)} names, got {names}")
        object.__setattr__(self, "axis_names", tuple(names))

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def peak_flops_for(self, dtype: str, family: str = "") -> float | None:
        """Flop/s of an op computing in ``dtype`` ("bfloat16", "float32", ...): its op
        family's measured rate when ``peak_flops_by_op`` lists ``family``."""
        by_op = dict(self.peak_flops_by_op)
        if family in by_op:
            return by_op[family]
        return dict(self.peak_flops_by_dtype).get(dtype, self.peak_flops)

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """Nodes x devices with their memory, compute and links (real or virtual)."""

    num_nodes: int = 1
    devices_per_node: int = 1
    memory_per_device: float = 16 * GB
    """Bytes of device memory."""
    peak_flops: float = 100e12
    """Per-device flop/s at the training precision, as reached by large matmuls."""
    memory_bandwidth: float = 1e12
    """Per-device memory bytes/s."""
    intra_node_bandwidth: float = 100 * GB
    """Bytes/s per device between devices of one node."""
    intra_node_latency: float = 5e-6
    inter_node_bandwidth: float = 12.5 * GB
    """Bytes/s per device between nodes."""
    inter_node_latency: float = 20e-6
    backend: str = "nccl"
    """'nccl' on GPUs, 'gloo' on CPUs."""
    name: str = "custom"
    peak_flops_by_dtype: tuple[tuple[str, float], ...] = ()
    """Per-device flop/s of matmuls in each dtype, e.g. (("bfloat16", 590e12),
    ("float32", 40e12)); a dtype not listed uses ``peak_flops``."""
    kernel_launch_s: float = 0.0
    """Seconds every op pays to launch (GPU kernel launch latency; 0 leaves it out)."""
    device_name: str = ""
    """The device model ("NVIDIA H100 80GB HBM3"), shown in plan summaries."""
    gradient_bucket_bytes: float = GRADIENT_BUCKET_BYTES
    """Bytes per gradient bucket the runtime issues (DDP's 25 MiB; the plan's
    ``all_reduce_threshold`` overrides it): gradient reductions share one latency per
    bucket in the cost model, as they do at run time. 0: one latency per gradient."""
    peak_flops_by_op: tuple[tuple[str, float], ...] = ()
    """Per-device flop/s of op families far from the matmul peak, e.g.
    (("convolution", 6e9),) for CPU convolutions (``measure_cluster()`` times them); a
    family not listed uses the dtype's peak."""
    optimizer_tensor_s: float = 0.0
    """Seconds the optimizer's step pays per parameter tensor whatever its size (measured
    for Adam by ``measure_cluster()``); 0 leaves the optimizer out of step estimates."""

    def __post_init__(self):
        for f in ("num_nodes", "devices_per_node"):
            if int(getattr(self, f)) < 1:
                raise ValueError(f"Cluster.{f} must be >= 1, got {getattr(self, f)}")
        for f in ("memory_per_device", "peak_flops", "memory_bandwidth", "intra_node_bandwidth",
                  "inter_node_bandwidth"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Cluster.{f} must be > 0, got {getattr(self, f)}")
        _check_non_negative(self, "Cluster", ("kernel_launch_s", "optimizer_tensor_s",
                                               "gradient_bucket_bytes"))
        object.__setattr__(self, "peak_flops_by_dtype", _dtype_peaks(self.peak_flops_by_dtype,
                                                                     "Cluster"))
        object.__setattr__(self, "peak_flops_by_op", _dtype_peaks(
            self.peak_flops_by_op, "Cluster", "peak_flops_by_op"))

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    # -- presets ------------------------------------------------------------------------
    @classmethod
    def h100(cls, num_nodes: int = 1, devices_per_node: int = 8) -> Cluster:
        """H100 SXM 80GB nodes: bf16 dense ~989 TF/s and fp32 67 TF/s (we assume ~60%
        reachable, ``gpu_specs``), NVLink 4 (~450 GB/s per direction per GPU), 400 Gb/s
        InfiniBand per GPU between nodes, 5 us per kernel launch."""
        return cls._gpu_preset("H100", num_nodes, devices_per_node, memory_per_device=80 * GB,
                               inter_node_bandwidth=50 * GB, name="h100")

    @classmethod
    def h200(cls, num_nodes: int = 1, devices_per_node: int = 8) -> Cluster:
        """H200 141GB nodes: H100 compute with 4.8 TB/s HBM3e, NVLink 4, 400 Gb/s between
        nodes."""
        return cls._gpu_preset("H200", num_nodes, devices_per_node, memory_per_device=141 * GB,
                               inter_node_bandwidth=50 * GB, name="h200")

    @classmethod
    def a100(cls, num_nodes: int = 1, devices_per_node: int = 8) -> Cluster:
        """A100 SXM 40GB nodes: bf16 dense 312 TF/s and fp32 19.5 TF/s (~60% reachable),
        NVLink 3 (~300 GB/s), 200 Gb/s InfiniBand per GPU between nodes."""
        return cls._gpu_preset("A100-SXM4-40GB", num_nodes, devices_per_node,
                               memory_per_device=40 * GB, inter_node_bandwidth=25 * GB,
                               name="a100")

    @classmethod
    def _gpu_preset(cls, model: str, num_nodes: int, devices_per_node: int, *,
                    memory_per_device: float, inter_node_bandwidth: float,
                    name: str) -> Cluster:
        """Nodes of one ``gpu_specs`` GPU model, TF32 off (PyTorch's default)."""
        from torchalpa.core import gpu_specs
        spec = gpu_specs.lookup(model)
        if spec is None:
            raise ValueError(f"unknown GPU model {model!r}")
        peaks = gpu_specs.peaks_by_dtype(spec, allow_tf32=False)
        return cls(num_nodes=num_nodes, devices_per_node=devices_per_node,
                   memory_per_device=memory_per_device, peak_flops=dict(peaks)["bfloat16"],
                   peak_flops_by_dtype=peaks, memory_bandwidth=spec.memory_bandwidth,
                   intra_node_bandwidth=spec.link_bandwidth, intra_node_latency=5e-6,
                   inter_node_bandwidth=inter_node_bandwidth, inter_node_latency=10e-6,
                   kernel_launch_s=gpu_specs.KERNEL_LAUNCH_S, name=name,
                   device_name=f"{spec.name} preset")

    @classmethod
    def local_cpu(cls, num_devices: int) -> Cluster:
        """CPU processes on one machine talking gloo over loopback (one thread each).

        Rough figures of a 2-core VM: ~30 Gflop/s per rank in fp32 matmul, ~1 GB/s
        effective gloo bandwidth and ~100 us per collective."""
        return cls(num_nodes=1, devices_per_node=num_devices, memory_per_device=8 * GB,
                   peak_flops=30e9, memory_bandwidth=5 * GB, intra_node_bandwidth=1 * GB,
                   intra_node_latency=100e-6, inter_node_bandwidth=1 * GB,
                   inter_node_latency=100e-6, backend="gloo", name="local_cpu")


    @classmethod
    def detect(cls, num_nodes: int | None = None, devices_per_node: int | None = None,
               *, memory_reserve: float = 1.5 * GB) -> Cluster:
        """The hardware this process runs on.

        On CUDA: the name of this rank's GPU, the memory its caching allocator can use
        (free + already reserved by this process, capped by the per-process memory
        fraction, less ``memory_reserve`` for the CUDA context's growth, cuBLAS workspaces
        and NCCL buffers), per-dtype peak flop/s and bandwidths of the model from
        ``gpu_specs`` (float32 at the TF32 rate when ``torch.get_float32_matmul_precision()``
        allows it), a kernel launch cost, and NCCL. Nodes and devices per node come from
        torchrun (``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``), else one node of every visible
        GPU; arguments override them. An unknown GPU warns and gets A100-like rates.
        Without CUDA (or with ``TORCHALPA_DEVICE=cpu``): ``local_cpu`` for the same number
        of devices.
        """
        import torch

        from torchalpa.core import gpu_specs
        nodes, per_node = _launch_shape(num_nodes, devices_per_node)
        if not cuda_selected():
            return cls.local_cpu(per_node if nodes == 1 else nodes * per_node)
        index = int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1)
        name = torch.cuda.get_device_name(index)
        free, total = torch.cuda.mem_get_info(index)
        usable = min(total, free + torch.cuda.memory_reserved(index))
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # newer torch
        if fraction is not None:
            usable = min(usable, total * fraction(index))
        usable = max(usable - memory_reserve, 0.1 * total)
        spec = gpu_specs.lookup(name)
        if spec is None:
            warnings.warn(f"Cluster.detect(): unknown GPU {name!r}: planning with A100-like "
                          "flop/s and bandwidths; pass Cluster(peak_flops=..., "
                          "memory_bandwidth=...) for exact figures", stacklevel=2)
            spec = gpu_specs.lookup("A100")
            assert spec is not None, "gpu_specs has no A100 entry"
        peaks = gpu_specs.peaks_by_dtype(
            spec, allow_tf32=torch.get_float32_matmul_precision() != "highest")
        return cls(num_nodes=nodes, devices_per_node=per_node, memory_per_device=float(usable),
                   peak_flops=dict(peaks)["bfloat16"], peak_flops_by_dtype=peaks,
                   memory_bandwidth=spec.memory_bandwidth,
                   intra_node_bandwidth=spec.link_bandwidth, intra_node_latency=5e-6,
                   inter_node_bandwidth=25 * GB, inter_node_latency=10e-6, backend="nccl",
                   name=f"detected {spec.name}", kernel_launch_s=gpu_specs.KERNEL_LAUNCH_S,
                   device_name=name)

    # -- logical meshes -----------------------------------------------------------------
    def logical_mesh(self, shape: tuple[int, ...] | None = None,
                     axis_names: tuple[str, ...] | None = None) -> LogicalMesh:
        """View all devices as a logical mesh; devices are numbered node-major."""
        shape = tuple(shape) if shape is not None else (self.num_devices,)
        n = math.prod(shape)
        if n != self.num_devices:
            raise ValueError(f"logical mesh {shape} has {n} devices but the cluster has "
                             f"{self.num_devices} ({self.num_nodes} x {self.devices_per_node})")
        alpha, beta = [], []
        stride = 1
        for size in reversed(shape):  # inner axes hold consecutive device ids
            span = stride * size       # consecutive ids touched by one group on this axis
            within = size == 1 or span <= self.devices_per_node
            alpha.append(self.intra_node_latency if within else self.inter_node_latency)
            beta.append(1.0 / (self.intra_node_bandwidth if within else self.inter_node_bandwidth))
            stride = span
        return LogicalMesh(shape=shape, alpha=tuple(reversed(alpha)), beta=tuple(reversed(beta)),
                           axis_names=axis_names, peak_flops=self.peak_flops,
                           memory_bandwidth=self.memory_bandwidth,
                           memory_per_device=self.memory_per_device, backend=self.backend,
                           peak_flops_by_dtype=self.peak_flops_by_dtype,
                           peak_flops_by_op=self.peak_flops_by_op,
                           optimizer_tensor_s=self.optimizer_tensor_s,
                           kernel_launch_s=self.kernel_launch_s,
                           device_name=self.device_name or self.name,
                           gradient_bucket_bytes=self.gradient_bucket_bytes)

    def candidate_shapes(self) -> list[tuple[int, ...]]:
        """Logical shapes worth trying: 1D, and 2D (n, m) for every factorization."""
        n = self.num_devices
        shapes: list[tuple[int, ...]] = [(n,)]
        for m in range(2, n):
            if n % m == 0:
                shapes.append((n // m, m))
        return shapes


def _check_non_negative(obj, owner: str, fields: tuple[str, ...]) -> None:
    """Raise naming the first of ``fields`` of ``obj`` that is negative."""
    for f in fields:
        if getattr(obj, f) < 0:
            raise ValueError(f"{owner}.{f} must be >= 0, got {getattr(obj, f)}")


def _dtype_peaks(value, owner: str, field: str = "peak_flops_by_dtype"
                 ) -> tuple[tuple[str, float], ...]:
    """Validated ((dtype or op family, flop/s), ...), given as such pairs or a dict."""
    items = value.items() if isinstance(value, dict) else value
    peaks = []
    for item in items:
        dtype, flops = item
        dtype = str(dtype).removeprefix("torch.")
        if not flops > 0:
            raise ValueError(f"{owner}.{field}[{dtype!r}] must be > 0, got {flops}")
        peaks.append((dtype, float(flops)))
    return tuple(sorted(peaks))


def _launch_shape(num_nodes: int | None, devices_per_node: int | None) -> tuple[int, int]:
    """(nodes, devices per node): the arguments, else torchrun's environment, else one node
    of every visible GPU (one device without CUDA)."""
    import torch
    world = int(os.environ.get("WORLD_SIZE", 0))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 0))
    if devices_per_node is None:
        devices_per_node = local or (world if world and num_nodes in (None, 1) else 0) or \
            (torch.cuda.device_count() if cuda_selected() else 1) or 1
    if num_nodes is None:
        num_nodes = max(1, world // devices_per_node) if world else 1
    return int(num_nodes), int(devices_per_node)
