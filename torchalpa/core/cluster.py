"""Clusters and logical meshes: the hardware the planner plans for.

A ``Cluster`` describes real or virtual hardware (nodes x devices, memory, flops,
bandwidths). ``Cluster.logical_mesh(shape)`` views its devices as a 1D or 2D logical mesh,
as Alpa's ``get_logical_mesh`` does, giving each mesh axis its own latency (alpha, s) and
inverse bandwidth (beta, s/byte): an axis whose devices share a node talks over the fast
intra-node link, an axis that crosses nodes over the network. ``LogicalMesh`` is what the
cost model reads; tests can build one directly (e.g. Alpa's alpha = beta = 1).

An axis's bandwidth is what NCCL's ring collectives reach over it, from how the devices of
each of its groups are linked (``axis_bandwidth``): on a switch (NVSwitch) every device
has ``intra_node_bandwidth`` to any other; on point-to-point links (a V100 hybrid cube
mesh, AMD's full mesh) a group gets what its worst-linked member's links to the others
carry together; a group spanning nodes gets, per rank, the NICs of its members on one
node together (NCCL's rings cross nodes through every member's NIC at once: a
data-parallel group of all 8 GPUs of each node moves 8 NICs' worth, one GPU per node one
NIC's), capped by the links inside the node.

``Cluster.preset(gpu, ...)`` builds nodes of a known GPU or machine
(``gpu_specs.NODE_PRESETS``: h100, h200, b200, a100-40, a100-80, v100-16, mi300x, ...,
p3.16xlarge, dgx-a100), with the efficiencies of ``gpu_specs`` applied.

``Cluster.detect()`` describes the hardware this process runs on: the GPU's name, the
memory its caching allocator can use, peak flop/s per dtype from a table of known GPUs
(``torchalpa/core/gpu_specs.py``), the node and device counts torchrun gives (``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``), and NCCL; without CUDA it is ``local_cpu``. ``measure_cluster()``
times the CPU machine a gloo process group runs on instead of guessing.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import warnings
from dataclasses import dataclass

from torchalpa.core.units import check_bytes

__all__ = ["Cluster", "LogicalMesh", "Submesh", "View"]

Submesh = tuple[int, int]
"""A submesh's shape: (nodes, devices per node), Alpa's (1, 1), (1, 2), ..., (N, M)."""
View = tuple[int, ...]
"""A logical mesh shape the devices of a submesh are viewed as, e.g. (2, 4) of (1, 8)."""

GB = 1e9
PCIE_THROUGH_HOST = 10 * GB
"""Bytes/s per direction between two GPUs of a linked node that share no link: NCCL goes
through PCIe and the host (``nvidia-smi topo -m``: SYS), ~10 GB/s on PCIe 3 servers."""
GRADIENT_BUCKET_BYTES = 25 * 2 ** 20
"""DDP's bucket size, the runtime's default (``runtime.rewrites.buckets.DEFAULT_BUCKET_BYTES``)."""


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
    """Host time every op pays to be issued, whatever its size: on CPU ranks (gloo) it adds
    to the op's time; on GPUs (nccl) kernels run asynchronously and an op costs the longer
    of its kernel and this (``passes/pricing/cost.compute_cost``)."""
    device_name: str = ""
    """The device planned for ("NVIDIA H100 80GB HBM3"), for the plan's summary."""
    gradient_bucket_bytes: float = 0.0
    """Bytes per bucket the runtime packs gradient reductions into, one latency each: a
    gradient's all-reduce pays the latency of its share of a bucket. 0: each gradient's
    collective pays a whole latency (Alpa's accounting, and these tests' default)."""
    peak_flops_by_op: tuple[tuple[str, float], ...] = ()
    """Per-device flop/s of op families that run far from the matmul peak, by family
    (``passes/pricing/cost.py::op_family``: "convolution" covers its backward too); a family not
    listed uses the dtype's peak."""
    optimizer_tensor_s: float = 0.0
    """Seconds the optimizer's step pays per parameter tensor whatever its size (its loop
    and element-wise launches; ``measure_cluster()`` times Adam). 0 leaves the optimizer
    out of the step's estimate (Alpa's accounting, and the hand-built meshes')."""
    multiprocessors: int = 0
    """Streaming multiprocessors per device: a matmul whose output tiles do not fill whole
    waves of them leaves some idle (``passes/pricing/kernel_model.py``). 0: not modeled."""
    op_rate_factors: tuple[tuple[str, float], ...] = ()
    """Op families whose kernels reach this fraction of their dtype's matmul rate (("sdpa",
    0.47): fused attention on an H100); a family not listed runs at the dtype's rate."""
    exp_rate: float = 0.0
    """Exponentials per second per device (the special-function units): what a fused
    attention's softmax takes per score whatever its head dim
    (``passes/pricing/attention_price.head_dim_seconds``). 0: not modeled."""
    eager_kernels: bool = True
    """Elementwise ops and normalizations run as PyTorch's eager kernels, which on 16-bit
    data fall short of the bandwidth (``passes/pricing/kernel_model.bandwidth_share``);
    False where a compiler or hand-fused kernels run them (``AutoShardingOption(
    elementwise="fused")``)."""
    host_op_s: float = 0.0
    """Host seconds an eager program spends issuing each of its ops from Python, views
    included (PyTorch's dispatch and the launch); the device runs a kernel once it is free
    and the host has issued it (``passes/pricing/overlap_price.py``), so a step of small
    kernels costs the host's time. Applied on GPUs (nccl) with ``eager_kernels``; 0: the
    host keeps ahead (Alpa's accounting, compiled programs)."""
    contention: float = 1.0
    """How much slower compute runs while a collective's kernel runs beside it on another
    stream (SMs and memory bandwidth shared): the overlapped part of a step costs this
    factor (``passes/pricing/overlap_price.py``). 1.0: overlapped communication is free."""

    def __post_init__(self):
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"LogicalMesh.backend must be 'nccl' or 'gloo', got {self.backend!r}")
        _check_non_negative(self, "LogicalMesh", ("kernel_launch_s", "optimizer_tensor_s",
                                               "gradient_bucket_bytes", "host_op_s",
                                               "exp_rate"))
        _check_contention(self, "LogicalMesh")
        object.__setattr__(self, "peak_flops_by_dtype", _dtype_peaks(self.peak_flops_by_dtype,
                                                                     "LogicalMesh"))
        object.__setattr__(self, "peak_flops_by_op", _dtype_peaks(
            self.peak_flops_by_op, "LogicalMesh", "peak_flops_by_op"))
        object.__setattr__(self, "op_rate_factors", _dtype_peaks(
            self.op_rate_factors, "LogicalMesh", "op_rate_factors"))
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
        family's measured rate when ``peak_flops_by_op`` lists ``family``, else the dtype's
        times ``op_rate_factors``' factor of the family; a float32 convolution at the
        "tf32" rate where one is listed (cuDNN allows TF32 by default)."""
        by_op = dict(self.peak_flops_by_op)
        if family in by_op:
            return by_op[family]
        peaks = dict(self.peak_flops_by_dtype)
        rate = peaks.get(dtype, self.peak_flops)
        if family == "convolution" and dtype == "float32":     # cuDNN's TF32 default
            rate = peaks.get("tf32", rate)
        factor = dict(self.op_rate_factors).get(family)
        return rate if rate is None or factor is None else rate * factor

    @property
    def ndim(self) -> int:
        return len(self.shape)


HOST_LINK_GEN4 = 25 * GB
"""PCIe Gen4 x16 between a device and host memory, as copies of pinned memory reach it."""
HOST_LINK_GEN5 = 55 * GB
"""PCIe Gen5 x16 (H100, H200, B200, L40S, MI300X hosts), as copies reach it."""
_GEN5 = re.compile(r"H100|H200|B200|GH200|L40S|L4\b|MI3", re.IGNORECASE)
_GEN3 = re.compile(r"V100|P100", re.IGNORECASE)


def host_link_of(device_name: str) -> float:
    """The host link of a device model: PCIe Gen5, Gen4 or Gen3 x16 as copies reach it."""
    if _GEN5.search(device_name):
        return HOST_LINK_GEN5
    return 12 * GB if _GEN3.search(device_name) else HOST_LINK_GEN4


def physical_memory() -> float | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def host_memory_of(device_name: str) -> float:
    """Host memory of the usual 8-GPU server of a device model: 2 TiB for DGX H100 /
    H200 / B200 class, 1 TiB for DGX A100, 512 GiB before."""
    if _GEN5.search(device_name):
        return 2048 * GB
    return 512 * GB if _GEN3.search(device_name) else 1024 * GB


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
    """Host seconds every op pays to be issued (added on CPUs, a floor on GPUs; 0 leaves it
    out)."""
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
    intra_node_links: tuple[tuple[int, ...], ...] = ()
    """Point-to-point links between the devices of a node, ``[i][j]`` of them between
    devices i and j (NVLink's hybrid cube mesh of 8 V100s, ``gpu_specs.HYBRID_CUBE_MESH``);
    empty: a switch, every device reaching any other at ``intra_node_bandwidth``."""
    intra_node_link_bandwidth: float = 0.0
    """Bytes/s per direction one of ``intra_node_links`` carries (as collectives reach it)."""
    multiprocessors: int = 0
    """Streaming multiprocessors per device (matmul wave quantization; 0: not modeled)."""
    op_rate_factors: tuple[tuple[str, float], ...] = ()
    """Op families reaching a fraction of their dtype's matmul rate (("sdpa", 0.47))."""
    exp_rate: float = 0.0
    """Exponentials per second per device (``LogicalMesh.exp_rate``); 0: not modeled."""
    host_link_bandwidth: float = HOST_LINK_GEN4
    """Bytes/s per device, each way, between a device and its host's memory (PCIe Gen4
    x16 as copies reach it, ~25 GB/s; Gen5 ~55 GB/s): what offloaded optimizer states
    pay (``AutoShardingOption.offload``)."""
    host_memory_per_node: float = 1024 * GB
    """Bytes of host memory a node lends to offloaded optimizer states."""
    host_memory_bandwidth: float = 200 * GB
    """Bytes/s the host's CPUs stream through memory, per node: the pace of an optimizer
    step run on the host."""
    host_op_s: float = 0.0
    """Host seconds an eager program spends issuing each op, views included (GPUs: a step
    cannot run faster than its host issues its kernels; ``LogicalMesh.host_op_s``); 0 leaves
    the host out."""
    contention: float = 1.0
    """Factor compute slows by while a collective runs beside it (``LogicalMesh.contention``);
    1.0: overlapped communication is free."""

    def __post_init__(self):
        _check_links(self)
        for f in ("num_nodes", "devices_per_node"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"Cluster.{f} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"Cluster.{f} must be >= 1, got {value}")
        check_bytes(self.memory_per_device, "Cluster.memory_per_device")
        check_bytes(self.host_memory_per_node, "Cluster.host_memory_per_node", positive=False)
        for f in ("memory_per_device", "peak_flops", "memory_bandwidth", "intra_node_bandwidth",
                  "inter_node_bandwidth"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Cluster.{f} must be > 0, got {getattr(self, f)}")
        _check_non_negative(self, "Cluster", ("kernel_launch_s", "optimizer_tensor_s",
                                               "gradient_bucket_bytes", "host_memory_per_node",
                                               "host_op_s", "exp_rate"))
        _check_contention(self, "Cluster")
        for f in ("host_link_bandwidth", "host_memory_bandwidth"):
            if getattr(self, f) <= 0:
                raise ValueError(f"Cluster.{f} must be > 0 bytes/s, got {getattr(self, f)}")
        object.__setattr__(self, "peak_flops_by_dtype", _dtype_peaks(self.peak_flops_by_dtype,
                                                                     "Cluster"))
        object.__setattr__(self, "peak_flops_by_op", _dtype_peaks(
            self.peak_flops_by_op, "Cluster", "peak_flops_by_op"))
        object.__setattr__(self, "op_rate_factors", _dtype_peaks(
            self.op_rate_factors, "Cluster", "op_rate_factors"))
        if self.multiprocessors < 0:
            raise ValueError(f"Cluster.multiprocessors must be >= 0, got {self.multiprocessors}")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    # -- presets ------------------------------------------------------------------------
    @classmethod
    def preset(cls, gpu: str, num_nodes: int = 1, devices_per_node: int | None = None, *,
               inter_node_bandwidth: float | None = None,
               memory_per_device: float | None = None,
               intra_node_bandwidth: float | None = None,
               allow_tf32: bool = False) -> Cluster:
        """Nodes of a known GPU or machine (``gpu_specs.NODE_PRESETS``).

        ``gpu``: a GPU ("h100", "h100-pcie", "h100-nvl", "h200", "b200", "a100-40",
        "a100-80", "a100-pcie", "v100-16", "v100-32", "l4", "l40s", "a10g", "a10", "t4",
        "mi300x", "mi325x", "rtx4090", "rtx3090"; its usual 8-GPU server and network) or
        a machine published benchmarks ran on ("p3.16xlarge", "p3dn.24xlarge", "dgx-1v",
        "dgx-2", "dgx-a100", "dgx-h100", "jean-zay-a100", "grand-teton-h100").
        ``devices_per_node``: GPUs per node (default: the machine's, 8 but for DGX-2's 16
        and Jean Zay's V100 nodes' 4; fewer use the first ones' links and each its own
        share of the node's NICs; more are refused: a preset names a node, its switch and
        NICs sized for its GPUs). Rates: ``gpu_specs.peaks_by_dtype`` (float32 at
        the TF32 rate when ``allow_tf32``), memory bandwidth at ``MEMORY_EFFICIENCY`` of
        the datasheet's, links at ``NVLINK_EFFICIENCY`` and the network at
        ``NETWORK_EFFICIENCY`` of theirs, fused attention at the GPU's share of its peak
        (``gpu_specs.op_factors``), ``KERNEL_LAUNCH_S`` of host time per op and the
        optimizer's step (``OPTIMIZER_TENSOR_S`` per tensor plus its memory traffic).

        Overrides, in the units of the Cluster's fields: ``inter_node_bandwidth`` (bytes/s
        per device, as collectives reach it; default the node's NICs shared by its GPUs),
        ``memory_per_device`` (bytes), ``intra_node_bandwidth`` (bytes/s per device on a
        switch).
        """
        from torchalpa.core import gpu_specs
        node = gpu_specs.node_preset(gpu)
        spec = gpu_specs.lookup(node.gpu)
        assert spec is not None, f"NODE_PRESETS names an unknown GPU {node.gpu!r}"
        per_node = node.devices_per_node if devices_per_node is None else int(devices_per_node)
        if per_node > node.devices_per_node:    # its NICs and links are for that many GPUs
            raise ValueError(f"Cluster.preset({gpu!r}): its nodes hold {node.devices_per_node} "
                             f"GPUs; devices_per_node={per_node} is more than a node holds "
                             f"(1 to {node.devices_per_node}; a larger node is another "
                             f"machine: build a Cluster(...) with its figures)")
        links = node.links
        link_bw = node.link_bandwidth * gpu_specs.NVLINK_EFFICIENCY
        switch_bw = spec.link_bandwidth * gpu_specs.NVLINK_EFFICIENCY
        if links:      # a whole node's collective: every link of the worst-linked device
            switch_bw = min(sum(row[:per_node]) for row in links[:per_node]) * link_bw \
                if per_node > 1 else switch_bw
        network = node.network_bandwidth * gpu_specs.NETWORK_EFFICIENCY / node.devices_per_node
        peaks = gpu_specs.peaks_by_dtype(spec, allow_tf32=allow_tf32)
        return cls(num_nodes=num_nodes, devices_per_node=per_node,
                   memory_per_device=gpu_specs.usable_memory(node.memory)
                   if memory_per_device is None else memory_per_device,
                   peak_flops=dict(peaks)["bfloat16"], peak_flops_by_dtype=peaks,
                   memory_bandwidth=spec.memory_bandwidth * gpu_specs.MEMORY_EFFICIENCY,
                   intra_node_bandwidth=switch_bw if intra_node_bandwidth is None
                   else intra_node_bandwidth,
                   intra_node_latency=5e-6,
                   inter_node_bandwidth=network if inter_node_bandwidth is None
                   else inter_node_bandwidth,
                   inter_node_latency=10e-6, kernel_launch_s=gpu_specs.KERNEL_LAUNCH_S,
                   optimizer_tensor_s=gpu_specs.OPTIMIZER_TENSOR_S,
                   host_op_s=gpu_specs.HOST_OP_S, contention=gpu_specs.CONTENTION,
                   multiprocessors=spec.multiprocessors, op_rate_factors=gpu_specs.op_factors(spec),
                   exp_rate=gpu_specs.exp_rate(spec),
                   intra_node_links=tuple(tuple(row[:per_node]) for row in links[:per_node]),
                   intra_node_link_bandwidth=link_bw if links else 0.0,
                   host_link_bandwidth=host_link_of(spec.name),
                   host_memory_per_node=host_memory_of(spec.name),
                   name=gpu.strip().lower(), device_name=f"{spec.name} preset")

    @classmethod
    def h100(cls, num_nodes: int = 1, devices_per_node: int = 8) -> Cluster:
        """H100 SXM 80GB nodes (``preset("h100")``): bf16 dense 989 TF/s and fp32 67 TF/s
        (``HOPPER_MATMUL_EFFICIENCY`` of them reachable, sustained), NVSwitch (450 GB/s per direction per
        GPU), 400 Gb/s InfiniBand per GPU between nodes, 5 us per kernel launch."""
        return cls.preset("h100", num_nodes, devices_per_node)

    @classmethod
    def h200(cls, num_nodes: int = 1, devices_per_node: int = 8) -> Cluster:
        """H200 141GB nodes (``preset("h200")``): H100 compute with 4.8 TB/s HBM3e,
        NVSwitch, 400 Gb/s per GPU between nodes."""
        return cls.preset("h200", num_nodes, devices_per_node)

    @classmethod
    def a100(cls, num_nodes: int = 1, devices_per_node: int = 8) -> Cluster:
        """A100 SXM 40GB nodes (``preset("a100-40")``): bf16 dense 312 TF/s and fp32
        19.5 TF/s, NVSwitch (300 GB/s per direction per GPU), 200 Gb/s InfiniBand per GPU
        between nodes."""
        return cls.preset("a100-40", num_nodes, devices_per_node)

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
        allows it), the efficiencies ``Cluster.preset`` applies, a kernel launch cost, and
        NCCL. Nodes and devices per node come from torchrun (``WORLD_SIZE`` /
        ``LOCAL_WORLD_SIZE``), else one node of every visible GPU; arguments override them.
        An unknown GPU warns and gets A100-like rates. Without CUDA (or with
        ``TORCHALPA_DEVICE=cpu``): ``local_cpu`` for the same number of devices.
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
                   memory_bandwidth=spec.memory_bandwidth * gpu_specs.MEMORY_EFFICIENCY,
                   intra_node_bandwidth=spec.link_bandwidth * gpu_specs.NVLINK_EFFICIENCY,
                   intra_node_latency=5e-6,
                   inter_node_bandwidth=25 * GB, inter_node_latency=10e-6, backend="nccl",
                   name=f"detected {spec.name}", kernel_launch_s=gpu_specs.KERNEL_LAUNCH_S,
                   host_link_bandwidth=host_link_of(spec.name),
                   host_memory_per_node=physical_memory() or host_memory_of(spec.name),
                   optimizer_tensor_s=gpu_specs.OPTIMIZER_TENSOR_S,
                   host_op_s=gpu_specs.HOST_OP_S, contention=gpu_specs.CONTENTION,
                   multiprocessors=spec.multiprocessors, op_rate_factors=gpu_specs.op_factors(spec),
                   exp_rate=gpu_specs.exp_rate(spec),
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
            beta.append(1.0 / self.axis_bandwidth(size, stride))
            stride = span
        return LogicalMesh(shape=shape, alpha=tuple(reversed(alpha)), beta=tuple(reversed(beta)),
                           axis_names=axis_names, peak_flops=self.peak_flops,
                           memory_bandwidth=self.memory_bandwidth,
                           memory_per_device=self.memory_per_device, backend=self.backend,
                           peak_flops_by_dtype=self.peak_flops_by_dtype,
                           peak_flops_by_op=self.peak_flops_by_op,
                           optimizer_tensor_s=self.optimizer_tensor_s,
                           multiprocessors=self.multiprocessors,
                           op_rate_factors=self.op_rate_factors, exp_rate=self.exp_rate,
                           kernel_launch_s=self.kernel_launch_s,
                           host_op_s=self.host_op_s, contention=self.contention,
                           device_name=self.device_name or self.name,
                           gradient_bucket_bytes=self.gradient_bucket_bytes)

    def axis_bandwidth(self, size: int, stride: int) -> float:
        """Bytes/s per rank a collective reaches over a mesh axis of ``size`` devices
        ``stride`` ids apart (module doc): the slowest of the axis's groups, each limited by
        its members' links inside a node and, across nodes, by their NICs together."""
        if size == 1:
            return self.intra_node_bandwidth
        per_node = self.devices_per_node
        slowest = math.inf
        for first in range(self.num_devices):
            if (first // stride) % size:     # not the first member of its group
                continue
            members = [first + j * stride for j in range(size)]
            nodes = {m // per_node for m in members}
            local = sorted(m % per_node for m in members if m // per_node == first // per_node)
            bandwidth = self._linked_bandwidth(local) if len(local) > 1 else math.inf
            if len(nodes) > 1:
                bandwidth = min(bandwidth, len(local) * self.inter_node_bandwidth)
            slowest = min(slowest, bandwidth)
            if not self.intra_node_links and first >= per_node:
                break                        # a switch: every node's groups alike
        return slowest

    def _linked_bandwidth(self, local: list[int]) -> float:
        """Bytes/s per rank among devices ``local`` of one node: a switch's
        ``intra_node_bandwidth``, else the worst-linked member's links to the others
        together (NCCL's rings use every link both ways), through the host without any."""
        if not self.intra_node_links:
            return self.intra_node_bandwidth
        links = min(sum(self.intra_node_links[i][j] for j in local if j != i) for i in local)
        if links == 0:
            return min(PCIE_THROUGH_HOST, self.intra_node_bandwidth)
        return links * self.intra_node_link_bandwidth

    def candidate_shapes(self) -> list[tuple[int, ...]]:
        """Logical shapes worth trying: 1D, and 2D (n, m) for every factorization."""
        n = self.num_devices
        shapes: list[tuple[int, ...]] = [(n,)]
        for m in range(2, n):
            if n % m == 0:
                shapes.append((n // m, m))
        return shapes


def _check_links(cluster: Cluster) -> None:
    """Raise unless ``intra_node_links`` is empty or a symmetric matrix of link counts
    covering a node, with a positive ``intra_node_link_bandwidth``."""
    links = cluster.intra_node_links
    if not links:
        return
    links = tuple(tuple(int(x) for x in row) for row in links)
    object.__setattr__(cluster, "intra_node_links", links)
    n = len(links)
    if any(len(row) != n for row in links) or any(
            links[i][j] != links[j][i] or links[i][j] < 0 for i in range(n) for j in range(n)):
        raise ValueError("Cluster.intra_node_links must be a symmetric square matrix of "
                         f"non-negative link counts, got {links}")
    if n < cluster.devices_per_node:
        raise ValueError(f"Cluster.intra_node_links covers {n} devices but a node has "
                         f"{cluster.devices_per_node}; give one row per device of a node")
    if not cluster.intra_node_link_bandwidth > 0:
        raise ValueError("Cluster.intra_node_link_bandwidth must be > 0 bytes/s when "
                         "intra_node_links is given")


def _check_non_negative(obj, owner: str, fields: tuple[str, ...]) -> None:
    """Raise naming the first of ``fields`` of ``obj`` that is negative."""
    for f in fields:
        if getattr(obj, f) < 0:
            raise ValueError(f"{owner}.{f} must be >= 0, got {getattr(obj, f)}")


def _check_contention(obj, owner: str) -> None:
    """Raise unless ``obj.contention`` is a slowdown factor (>= 1)."""
    if not obj.contention >= 1.0:
        raise ValueError(f"{owner}.contention must be >= 1.0 (how many times slower compute "
                         f"runs beside a collective; 1.0: no contention), got {obj.contention}")


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
