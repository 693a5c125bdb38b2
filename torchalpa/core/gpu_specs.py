"""Datasheet figures of known GPUs and of the nodes they come in, for ``Cluster.detect()``
and ``Cluster.preset()``.

PyTorch can read a GPU's name and memory but not its peak arithmetic rate, so the rates
come from the vendors' datasheets: dense (no structured sparsity) tensor-core flop/s for
bf16/fp16 and tf32, plain fp32 (CUDA cores: what an fp32 matmul reaches while
``torch.backends.cuda.matmul.allow_tf32`` is off, PyTorch's default), memory bandwidth and
the per-GPU NVLink (or PCIe) bandwidth within a node, per direction. ``lookup(name)``
matches the name ``torch.cuda.get_device_name()`` reports ("NVIDIA H100 80GB HBM3",
"NVIDIA A100-SXM4-40GB", "Tesla V100-SXM2-16GB", ...); the first pattern that matches
wins, so variants come before the family name.

What a program reaches is a fraction of those peaks, and the fractions are hardware
facts measured by public microbenchmarks, the same for every model:

- ``MATMUL_EFFICIENCY``: a large tensor-core matmul (cuBLAS / rocBLAS, long K, many
  waves of tiles) reaches 0.7-0.87 of the dense peak (A100 fp16 ~250-270 of 312 TF, H100
  bf16 ~700-780 of 989, V100 fp16 ~100-110 of 125); 0.75. ``passes/pricing/kernel_model.py`` adds
  what a real matmul pays on top: its result written after its K loop (so a K of 2048
  reaches ~0.69 on an H200, one of 768 ~0.6: the flat 0.6 the presets assumed before
  matched LLaMA 1B's step on an H200, issue 37, and not GPT-2's) and the idle SMs of a
  last partial wave of tiles.
- ``HOPPER_MATMUL_EFFICIENCY``: Hopper (GH100) parts, ``GpuSpec.matmul_efficiency``, reach
  less of their datasheet peak once they run matmuls for longer than a burst: the
  datasheet rate is at the boost clock, which a GH100 does not hold under a long chain
  of dense tensor-core work. Measured on this project's H200 (GH100 at 700 W, 2026-11-28,
  ``benchmarks/gpu_logs/h200-2026-11-28/overlap.log``, ``benchmarks/gpu_overlap.py``): 24
  bf16 8192^3 matmuls back to back, median of 5 chains after a warm-up, 38.1 ms: 692
  TFLOP/s, 0.70 of 989; the same shape timed as a burst of 5 calls (``torchalpa
  calibrate``, ``calib.log``) read 802 (0.81), a rate a training step's seconds of
  matmuls do not keep. 0.70 for every tensor-core dtype of every GH100 part (H100 SXM,
  PCIe, NVL, 96GB; H200), as the 0.75 is for the others; attention keeps its own share
  of the peak (``op_factors``).
- ``FP32_MATMUL_EFFICIENCY``: a float32 matmul on the CUDA cores (TF32 off) reaches 0.8-0.9
  of the fp32 peak (SGEMM is compute bound with room to spare: 14 of V100's 15.7 TF, ~18 of
  A100's 19.5); 0.8. LLaMA 1B in float32 on one H200 ran 1049 ms where 0.6 priced 1363.
- ``GpuSpec.attention``: fused attention (FlashAttention-2 and the like) reaches a smaller
  share of the peak than a GEMM: it is priced at that fraction (``peaks``' "sdpa" factor),
  a figure for head dim 128 (the large models' heads the papers time).
- ``exp_rate``: the special-function units' exponentials per second (``SFU_PER_CLOCK``
  per SM per clock at ``GpuSpec.boost_clock``): a fused attention's softmax takes one
  exponential per score whatever the head dim, which the attention figure includes at
  head dim 128 (``passes/pricing/attention_price.head_dim_seconds``).
- ``MEMORY_EFFICIENCY``: a streaming kernel (copy, add, a normalization) moves about 0.8-0.9
  of the datasheet bandwidth (BabelStream / STREAM on V100, A100, H100 and MI250X: 80-93 %);
  PyTorch's eager elementwise kernels sit at the low end, so 0.8.
- ``NVLINK_EFFICIENCY`` and ``NETWORK_EFFICIENCY``: the bus bandwidth NCCL's collectives
  reach on a link, as nccl-tests reports it (all-reduce busbw on DGX A100 ~230-240 GB/s of
  300, DGX H100 ~360-380 of 450 without NVLS, DGX-1V ~130 of 150; on InfiniBand 90-95 % of
  the line rate).

``NODE_PRESETS`` names the nodes ``Cluster.preset`` builds clusters of: one per GPU model
(the usual 8-GPU server of that GPU), and the machines published benchmarks ran on
(``p3.16xlarge``, ``dgx-a100``, ...), each with how its GPUs are linked and its network.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["GpuSpec", "NodeSpec", "KNOWN_GPUS", "NODE_PRESETS", "lookup", "node_preset",
           "MATMUL_EFFICIENCY", "HOPPER_MATMUL_EFFICIENCY", "FP32_MATMUL_EFFICIENCY", "MEMORY_EFFICIENCY",
           "NVLINK_EFFICIENCY", "NETWORK_EFFICIENCY", "KERNEL_LAUNCH_S", "OPTIMIZER_TENSOR_S",
           "HOST_OP_S", "CONTENTION",
           "CONVOLUTION_SHARE", "usable_memory", "DRIVER_VISIBLE", "CUDA_CONTEXT_BYTES",
           "DETECT_RESERVE_BYTES",
           "HYBRID_CUBE_MESH", "peaks_by_dtype", "op_factors", "SFU_PER_CLOCK", "exp_rate"]

T = 1e12
GB = 1e9
GHZ = 1e9
Gbit = 1e9 / 8
DRIVER_VISIBLE = 0.99
"""Share of a card's sold memory that CUDA reports as its total: a card sold as "80GB"
holds 80 GiB of HBM and reports 79.2-79.6 GiB (A100 80GB, H100 SXM); "16GB" V100s report
15.8 GiB, the H200 ("141GB") 140.4 GiB."""
CUDA_CONTEXT_BYTES = 0.5 * 2**30
"""Device memory the CUDA context and the libraries' handles take before the first tensor."""
DETECT_RESERVE_BYTES = 1.5 * GB
"""What ``Cluster.detect`` leaves unplanned on a real card (its ``memory_reserve``: the
context's growth, cuBLAS workspaces, NCCL buffers)."""
MATMUL_EFFICIENCY = 0.75
"""Fraction of the datasheet peak a large tensor-core matmul (long K) reaches."""
HOPPER_MATMUL_EFFICIENCY = 0.70
"""The same on a Hopper (GH100) part, sustained: measured on an H200 (module doc)."""
FP32_MATMUL_EFFICIENCY = 0.8
"""Fraction of the fp32 (CUDA-core) peak a large float32 matmul reaches, TF32 off."""
MEMORY_EFFICIENCY = 0.8
"""Fraction of the datasheet memory bandwidth a streaming kernel reaches."""
NVLINK_EFFICIENCY = 0.8
"""Fraction of the NVLink / Infinity Fabric / PCIe bandwidth NCCL's collectives reach."""
NETWORK_EFFICIENCY = 0.9
"""Fraction of the NICs' line rate NCCL's collectives reach between nodes."""
KERNEL_LAUNCH_S = 10e-6
"""Host time to issue one op on a GPU (Python, ATen dispatch, the launch): eager PyTorch and
torchalpa's programs spend ~10 us per op (issue 37: a 4 x 256 GPT ran 641 kernels in
6.84 ms on an H200, host-bound). Kernels run asynchronously, so an op costs the longer of
its kernel and this (``passes/pricing/cost.py``)."""

HOST_OP_S = 22e-6
"""Host seconds torchalpa's eager programs spend per captured op, views included (the
generated Python, ATen's dispatch, the launch): a step cannot run faster than its host
issues its kernels (``LogicalMesh.host_op_s``; the step walk of
``passes/pricing/overlap_price.py``). Fitted on the H200 of 2026-11-28 (PyTorch 2.11) over
the 14 one-GPU rows of ``benchmarks/one_gpu.py`` (7 zoo models, fp32 and bf16: 415 to
3837 ops a step), one constant for all: ``benchmarks/host_per_op.py`` minimizes the
squared log of estimate / measured. The host-bound rows alone run 19-27 us per op (ViT
and BERT bf16 19.4 and 20.8, the small GPT 22.9 fp32 and 27.1 bf16); ``torchalpa
calibrate``'s stream of one tiny op repeated, 8.2 us, is the floor of a bare dispatch."""
CONTENTION = 1.35
"""Factor compute slows by while a collective's kernel runs beside it on another stream
(``LogicalMesh.contention``): SMs and memory bandwidth are shared. On the H200 of
2026-11-28 (``benchmarks/gpu_overlap.py``, ``gpu_logs/h200-2026-11-28/overlap.log``) 24
bf16 8192^3 matmuls ran 1.35x slower beside a device-to-device copy kernel on a side
stream (38.1 -> 51.4 ms; the copy alone 16.2 ms, 2.1 TB/s: a collective's memory
traffic). The copy kernel takes every SM it can where NCCL's kernels take one per channel
(16-32 of 132); losing 32 of 132 SMs alone would be 1/(1 - 32/132) = 1.32x. Not measured
with NCCL (one GPU)."""

CONVOLUTION_SHARE = 0.2
"""Share of its dtype's matmul rate a cuDNN convolution of a CNN's training step reaches
(PyTorch's default NCHW layout: cuDNN transposes to and from the tensor cores' NHWC around
implicit GEMMs whose K, channels x kernel area, is short in the early layers). On the
H200 of 2026-11-28 ResNet-34's step ran 61 ms in bf16 and 81 ms in float32 (convolutions
at TF32) against 5.5 TFLOP of convolutions, 0.16-0.22 of the priced matmul rates once its
elementwise kernels are taken off; NVIDIA's published ResNet-50 training throughputs
(DeepLearningExamples, A100: ~2,700 images/s AMP, ~1,400 TF32) are ~0.2 of the dense
peaks for the whole step. One factor for the family, every GPU; a float32 convolution
runs at the TF32 rate (``torch.backends.cudnn.allow_tf32`` is on by default, unlike
matmuls': ``LogicalMesh.peak_flops_for``)."""

OPTIMIZER_TENSOR_S = 2e-6
"""Host time torch's foreach / fused Adam spends per parameter tensor on a GPU (its kernels
take lists of tensors); its memory traffic is priced apart (``passes/pricing/cost.optimizer_cost``)."""


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU model's datasheet figures (per device, dense)."""

    name: str
    fp32: float                 # flop/s, CUDA cores (AMD: fp32 matrix cores)
    tf32: float                 # flop/s, tensor cores (fp32 matmuls with TF32 allowed)
    bf16: float                 # flop/s, tensor cores, fp32 accumulation
    memory_bandwidth: float     # bytes/s
    link_bandwidth: float       # bytes/s per GPU to the others of its node, per direction
    memory: float               # bytes on the card (the largest variant)
    fp16: float | None = None   # flop/s of fp16 tensor cores where bf16 has none (V100, T4)
    multiprocessors: int = 0    # SMs (AMD: compute units): the waves a matmul's tiles fill
    attention: float = 0.5      # fused attention's flop/s as a fraction of the dense peak
    matmul_efficiency: float = MATMUL_EFFICIENCY    # a large matmul's share of the peaks
    boost_clock: float = 0.0    # Hz, the datasheet's maximum boost clock (0: not listed)


# (regex on the reported name, spec); variants first. Sources: NVIDIA's datasheets (H100
# Tensor Core GPU, H200, HGX B200, A100 80GB/40GB, L4, L40S, A10, V100, T4), AMD Instinct
# MI300X / MI325X datasheets; link figures are NVLink's per-direction bandwidth (half the
# "bidirectional" figure the datasheets print), or PCIe's per direction; SM counts from the
# architecture whitepapers (GH100: 132 SMs on SXM, 114 on PCIe; GA100: 108; GV100: 80).
# ``attention``: FlashAttention-2's flop/s over the dense peak, forward and backward (Dao
# 2023: 50-73 % / 45-63 % on A100; Shah et al. 2024, FlashAttention-3 paper: FA2 reaches
# ~35 % of H100's peak), V100/T4 the memory-efficient kernel; 0.5 where nothing is published.
# ``boost_clock``: the datasheets' and whitepapers' maximum boost clock (GA100 1410 MHz,
# GH100 SXM 1980, PCIe 1755, NVL 1785, GV100 SXM2 1530); not listed (0) for B200 and AMD.
_ = GpuSpec
_GH100 = {"attention": 0.35, "matmul_efficiency": HOPPER_MATMUL_EFFICIENCY}
KNOWN_GPUS: tuple[tuple[str, GpuSpec], ...] = (
    (r"H100.*PCIe", _("H100 PCIe", 51 * T, 378 * T, 756 * T, 2.0e12, 64 * GB, 80 * GB,
                      multiprocessors=114, boost_clock=1.755 * GHZ, **_GH100)),
    (r"H100.*NVL", _("H100 NVL", 60 * T, 418 * T, 835 * T, 3.9e12, 300 * GB, 94 * GB,
                     multiprocessors=132, boost_clock=1.785 * GHZ, **_GH100)),
    # torchtitan's Grand Teton H100s: 96 GB HBM2e at 2.4 TB/s, 500 W; "the actual peak
    # TFLOPs number is between SXM and NVL" (its benchmark file's footnote): the midpoint
    # of H100 SXM's 989 and H100 NVL's 835 TF, the other rates scaled alike
    (r"H100.*96GB|H100.*HBM2e", _("H100 96GB HBM2e", 63.5 * T, 456 * T, 912 * T, 2.4e12,
                                  450 * GB, 96 * GB, multiprocessors=132,
                                  boost_clock=1.98 * GHZ, **_GH100)),
    (r"H100|H800", _("H100 SXM", 67 * T, 495 * T, 989 * T, 3.35e12, 450 * GB, 80 * GB,
                     multiprocessors=132, boost_clock=1.98 * GHZ, **_GH100)),
    (r"H200|GH200", _("H200", 67 * T, 495 * T, 989 * T, 4.8e12, 450 * GB, 141 * GB,
                      multiprocessors=132, boost_clock=1.98 * GHZ, **_GH100)),
    (r"B200", _("B200", 80 * T, 1100 * T, 2250 * T, 8.0e12, 900 * GB, 192 * GB,
                multiprocessors=148)),
    (r"A100.*80GB.*PCIe|A100.*PCIe.*80GB",
     _("A100 80GB PCIe", 19.5 * T, 156 * T, 312 * T, 1.94e12, 32 * GB, 80 * GB,
       multiprocessors=108, attention=0.55, boost_clock=1.41 * GHZ)),
    (r"A100.*80GB", _("A100 80GB", 19.5 * T, 156 * T, 312 * T, 2.04e12, 300 * GB, 80 * GB,
                      multiprocessors=108, attention=0.55, boost_clock=1.41 * GHZ)),
    (r"A100.*PCIE|A100.*PCIe",
     _("A100 40GB PCIe", 19.5 * T, 156 * T, 312 * T, 1.56e12, 32 * GB, 40 * GB,
       multiprocessors=108, attention=0.55, boost_clock=1.41 * GHZ)),
    (r"A100|A800", _("A100 40GB", 19.5 * T, 156 * T, 312 * T, 1.56e12, 300 * GB, 40 * GB,
                     multiprocessors=108, attention=0.55, boost_clock=1.41 * GHZ)),
    (r"L40S", _("L40S", 91.6 * T, 183 * T, 362 * T, 0.864e12, 32 * GB, 48 * GB,
                multiprocessors=142, boost_clock=2.52 * GHZ)),
    (r"\bL40\b", _("L40", 90.5 * T, 90.5 * T, 181 * T, 0.864e12, 32 * GB, 48 * GB,
                   multiprocessors=142, boost_clock=2.49 * GHZ)),
    (r"\bL4\b", _("L4", 30.3 * T, 60 * T, 121 * T, 0.3e12, 32 * GB, 24 * GB,
                  multiprocessors=58, boost_clock=2.04 * GHZ)),
    (r"\bA10G\b", _("A10G", 31.2 * T, 35 * T, 70 * T, 0.6e12, 16 * GB, 24 * GB,
                    multiprocessors=80, boost_clock=1.71 * GHZ)),
    (r"\bA10\b", _("A10", 31.2 * T, 62.5 * T, 125 * T, 0.6e12, 32 * GB, 24 * GB,
                   multiprocessors=72, boost_clock=1.695 * GHZ)),
    # V100 and T4 have no tf32 and no bf16 tensor cores: bf16 runs at about the fp32 rate,
    # fp16 on tensor cores (V100 SXM2: 125 TF, 900 GB/s HBM2, 6 NVLink2 links of 25 GB/s)
    (r"V100.*16GB", _("V100 16GB", 15.7 * T, 15.7 * T, 15.7 * T, 0.9e12, 150 * GB, 16 * GB,
                      fp16=125 * T, multiprocessors=80, attention=0.3,
                      boost_clock=1.53 * GHZ)),
    (r"V100", _("V100", 15.7 * T, 15.7 * T, 15.7 * T, 0.9e12, 150 * GB, 32 * GB,
                fp16=125 * T, multiprocessors=80, attention=0.3, boost_clock=1.53 * GHZ)),
    (r"\bT4\b", _("T4", 8.1 * T, 8.1 * T, 8.1 * T, 0.32e12, 16 * GB, 16 * GB, fp16=65 * T,
                  multiprocessors=40, attention=0.3, boost_clock=1.59 * GHZ)),
    # AMD Instinct: fp32 matmuls run on the matrix cores (163.4 TF), 7 Infinity Fabric links
    # of 64 GB/s per direction to the other 7 GPUs of an OAM platform, 304 compute units
    (r"MI325X", _("MI325X", 163.4 * T, 653.7 * T, 1307.4 * T, 6.0e12, 448 * GB, 256 * GB,
                  multiprocessors=304)),
    (r"MI300X", _("MI300X", 163.4 * T, 653.7 * T, 1307.4 * T, 5.3e12, 448 * GB, 192 * GB,
                  multiprocessors=304)),
    (r"RTX 4090", _("RTX 4090", 82.6 * T, 82.6 * T, 165 * T, 1.0e12, 32 * GB, 24 * GB,
                    multiprocessors=128, boost_clock=2.52 * GHZ)),
    (r"RTX 3090", _("RTX 3090", 35.6 * T, 35.6 * T, 71 * T, 0.94e12, 32 * GB, 24 * GB,
                    multiprocessors=82, boost_clock=1.695 * GHZ)),
)
del _, _GH100

HYBRID_CUBE_MESH: tuple[tuple[int, ...], ...] = (
    (0, 1, 1, 2, 2, 0, 0, 0),
    (1, 0, 2, 1, 0, 2, 0, 0),
    (1, 2, 0, 2, 0, 0, 1, 0),
    (2, 1, 2, 0, 0, 0, 0, 1),
    (2, 0, 0, 0, 0, 1, 1, 2),
    (0, 2, 0, 0, 1, 0, 2, 1),
    (0, 0, 1, 0, 1, 2, 0, 2),
    (0, 0, 0, 1, 2, 1, 2, 0),
)
"""NVLink links between the 8 V100s of a DGX-1V / AWS p3.16xlarge (``nvidia-smi topo -m``:
NV1 = one link, NV2 = two; 0 = no NVLink, through PCIe and the CPUs): every GPU has six
25 GB/s links, to the three others of its quad and one or two of the other quad."""
_FULL_MESH_8 = tuple(tuple(0 if i == j else 1 for j in range(8)) for i in range(8))
"""Every GPU linked once to each other one (AMD MI300X OAM platforms)."""
_FULL_MESH_4_DOUBLE = tuple(tuple(0 if i == j else 2 for j in range(4)) for i in range(4))
"""Four SXM2 GPUs, each pair joined by two NVLink 2 links (6 links per GPU, all to peers)."""


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A server of GPUs: which GPU, how much memory each may use, how they are linked, and
    the network between servers."""

    gpu: str
    """A name ``lookup`` finds ("H100 SXM", "V100 16GB")."""
    memory: float
    """The device memory a GPU is sold with ("80GB": ``80 * GB``); the budget a preset plans
    with is ``usable_memory`` of it."""
    network_bandwidth: float
    """Bytes/s per direction the node's NICs carry together (8 x 200 Gb/s HDR: 200 GB/s)."""
    devices_per_node: int = 8
    links: tuple[tuple[int, ...], ...] = ()
    """Point-to-point links between the node's GPUs (``links[i][j]`` of them between GPUs i
    and j, each ``link_bandwidth`` per direction); empty: a switch (NVSwitch, or PCIe for
    boards without NVLink) gives every GPU its ``GpuSpec.link_bandwidth`` to any other."""
    link_bandwidth: float = 0.0
    """Bytes/s per direction of one link of ``links``."""
    note: str = ""
    """What the figures are, with their source."""


NODE_PRESETS: dict[str, NodeSpec] = {
    # DGX/HGX H100: NVLink 4 through NVSwitch (900 GB/s bidirectional per GPU), 8 x 400 Gb/s
    # ConnectX-7 NDR (NVIDIA DGX H100 datasheet)
    "h100": NodeSpec("H100 SXM", 80 * GB, 8 * 400 * Gbit,
                     note="DGX H100: NVSwitch 450 GB/s per GPU, 8 x 400 Gb/s NDR"),
    "h100-pcie": NodeSpec("H100 PCIe", 80 * GB, 4 * 400 * Gbit,
                          note="8 x H100 PCIe (PCIe 5 x16), 4 x 400 Gb/s [assumed]"),
    "h100-nvl": NodeSpec("H100 NVL", 94 * GB, 4 * 400 * Gbit,
                         note="H100 NVL pairs (NVLink bridge 300 GB/s), 4 x 400 Gb/s [assumed]"),
    # DGX H200: same NVLink/NDR fabric as DGX H100 (NVIDIA DGX H200 datasheet)
    "h200": NodeSpec("H200", 141 * GB, 8 * 400 * Gbit,
                     note="DGX H200: NVSwitch 450 GB/s per GPU, 8 x 400 Gb/s NDR"),
    # DGX B200: 180 GB usable per GPU (1,440 GB for 8), NVLink 5 (1.8 TB/s bidirectional),
    # 8 x 400 Gb/s ConnectX-7 (NVIDIA DGX B200 datasheet)
    "b200": NodeSpec("B200", 180 * GB, 8 * 400 * Gbit,
                     note="DGX B200: NVSwitch 900 GB/s per GPU, 8 x 400 Gb/s"),
    # DGX A100: NVLink 3 through NVSwitch (600 GB/s bidirectional per GPU), 8 x 200 Gb/s
    # HDR InfiniBand for compute (NVIDIA DGX A100 datasheet; Selene, Narayanan et al. 2021)
    "a100-40": NodeSpec("A100 40GB", 40 * GB, 8 * 200 * Gbit,
                        note="DGX A100 320GB: NVSwitch 300 GB/s per GPU, 8 x 200 Gb/s HDR"),
    "a100-80": NodeSpec("A100 80GB", 80 * GB, 8 * 200 * Gbit,
                        note="DGX A100 640GB: NVSwitch 300 GB/s per GPU, 8 x 200 Gb/s HDR"),
    "a100-pcie": NodeSpec("A100 40GB PCIe", 40 * GB, 2 * 200 * Gbit,
                          note="8 x A100 PCIe (PCIe 4 x16), 2 x 200 Gb/s [assumed]"),
    # V100 SXM2 in the hybrid cube mesh of DGX-1V / p3: six NVLink 2 links of 25 GB/s
    "v100-16": NodeSpec("V100 16GB", 16 * GB, 25 * Gbit, links=HYBRID_CUBE_MESH,
                        link_bandwidth=25 * GB,
                        note="AWS p3.16xlarge: 8 x V100 16GB, NVLink hybrid cube mesh, 25 Gb/s"),
    "v100-32": NodeSpec("V100", 32 * GB, 100 * Gbit, links=HYBRID_CUBE_MESH,
                        link_bandwidth=25 * GB,
                        note="AWS p3dn.24xlarge: 8 x V100 32GB, NVLink hybrid cube mesh, "
                             "100 Gb/s"),
    "l4": NodeSpec("L4", 24 * GB, 100 * Gbit,
                   note="GCP g2-standard-96: 8 x L4 on PCIe 4 (32 GB/s), 100 Gb/s"),
    "l40s": NodeSpec("L40S", 48 * GB, 4 * 100 * Gbit,
                     note="8 x L40S on PCIe 4 (32 GB/s), 4 x 100 Gb/s [assumed]"),
    "a10g": NodeSpec("A10G", 24 * GB, 100 * Gbit,
                     note="AWS g5.48xlarge: 8 x A10G on PCIe 4, 100 Gb/s"),
    "a10": NodeSpec("A10", 24 * GB, 100 * Gbit, note="8 x A10 on PCIe 4, 100 Gb/s [assumed]"),
    "t4": NodeSpec("T4", 16 * GB, 100 * Gbit,
                   note="AWS g4dn.metal: 8 x T4 on PCIe 3 (16 GB/s), 100 Gb/s"),
    # AMD MI300X OAM platform: every GPU linked to the 7 others (7 x 128 GB/s bidirectional),
    # 8 x 400 Gb/s (AMD Instinct MI300X platform datasheet)
    "mi300x": NodeSpec("MI300X", 192 * GB, 8 * 400 * Gbit, links=_FULL_MESH_8,
                       link_bandwidth=64 * GB,
                       note="MI300X platform: Infinity Fabric full mesh, 64 GB/s per link, "
                            "8 x 400 Gb/s"),
    "mi325x": NodeSpec("MI325X", 256 * GB, 8 * 400 * Gbit, links=_FULL_MESH_8,
                       link_bandwidth=64 * GB,
                       note="MI325X platform: Infinity Fabric full mesh, 8 x 400 Gb/s"),
    "rtx4090": NodeSpec("RTX 4090", 24 * GB, 100 * Gbit,
                        note="8 x RTX 4090 on PCIe 4, 100 Gb/s [assumed]"),
    "rtx3090": NodeSpec("RTX 3090", 24 * GB, 100 * Gbit,
                        note="8 x RTX 3090 on PCIe 4, 100 Gb/s [assumed]"),
    # -- the machines published benchmarks ran on --------------------------------------
    "p3.16xlarge": NodeSpec("V100 16GB", 16 * GB, 25 * Gbit, links=HYBRID_CUBE_MESH,
                            link_bandwidth=25 * GB,
                            note="AWS p3.16xlarge (Alpa's benchmarks): 8 x V100 16GB, NVLink "
                                 "hybrid cube mesh, 25 Gb/s network"),
    "p3dn.24xlarge": NodeSpec("V100", 32 * GB, 100 * Gbit, links=HYBRID_CUBE_MESH,
                              link_bandwidth=25 * GB,
                              note="AWS p3dn.24xlarge: 8 x V100 32GB, hybrid cube mesh, "
                                   "100 Gb/s"),
    "dgx-1v": NodeSpec("V100", 32 * GB, 4 * 100 * Gbit, links=HYBRID_CUBE_MESH,
                       link_bandwidth=25 * GB,
                       note="DGX-1V: 8 x V100 32GB, hybrid cube mesh, 4 x 100 Gb/s EDR"),
    # DGX-2: 16 V100 32GB on NVSwitch (6 NVLink 2 links, 150 GB/s per direction each),
    # 8 x 100 Gb/s EDR (NVIDIA DGX-2 datasheet; Megatron-LM's 2020 V100 table)
    "dgx-2": NodeSpec("V100", 32 * GB, 8 * 100 * Gbit, devices_per_node=16,
                      note="DGX-2: 16 x V100 32GB on NVSwitch (150 GB/s per GPU), "
                           "8 x 100 Gb/s EDR"),
    "dgx-a100": NodeSpec("A100 80GB", 80 * GB, 8 * 200 * Gbit,
                         note="DGX A100 (Selene): 8 x A100 80GB, NVSwitch 300 GB/s per GPU, "
                              "8 x 200 Gb/s HDR InfiniBand"),
    "dgx-h100": NodeSpec("H100 SXM", 80 * GB, 8 * 400 * Gbit,
                         note="DGX H100: NVSwitch 450 GB/s per GPU, 8 x 400 Gb/s NDR"),
    # Jean Zay's A100 80GB nodes (BLOOM): NVLink (NVSwitch), 4 x 100 Gb/s Omni-Path
    "jean-zay-a100": NodeSpec("A100 80GB", 80 * GB, 4 * 100 * Gbit,
                              note="Jean Zay (BLOOM-176B): 8 x A100 80GB, NVSwitch, "
                                   "4 x 100 Gb/s Omni-Path"),
    # Jean Zay's quad-V100 converged nodes (BigScience's tr1-13B, 2021): 4 x V100 SXM2 32GB,
    # every pair joined by 2 of each GPU's 6 NVLink 2 links [assumed: the usual 4-GPU SXM2
    # board]; "Omni-Path interconnection network 100 Gb/s (1 link per scalar node and 4
    # links per converged node)" (IDRIS, jean-zay-cpu-hw-eng.html, as quoted in
    # PencilFFTs.jl's Jean-Zay benchmark notes, 2020): 4 x 100 Gb/s
    "jean-zay-v100": NodeSpec("V100", 32 * GB, 4 * 100 * Gbit, devices_per_node=4,
                              links=_FULL_MESH_4_DOUBLE, link_bandwidth=25 * GB,
                              note="Jean Zay (BigScience tr1-13B): 4 x V100 32GB, NVLink 2 "
                                   "x 2 between each pair [assumed], 4 x 100 Gb/s Omni-Path "
                                   "(IDRIS: 4 links per converged node)"),
    # Meta's Grand Teton H100 hosts of torchtitan's benchmarks: 96 GB HBM2e parts at 500 W
    # (2.4 TB/s; lower clocks), NVLink, 400 Gb/s RDMA per GPU
    "grand-teton-h100": NodeSpec("H100 96GB HBM2e", 96 * GB, 8 * 400 * Gbit,
                                 note="torchtitan's H100 hosts: 96 GB HBM2e (2.4 TB/s), 500 W, "
                                      "NVLink, 400 Gb/s per GPU"),
    # GPT-NeoX-20B's servers (Black et al. 2022, section 2.3): Supermicro AS-4124GO-NART,
    # 8 x A100-SXM4-40GB (the HGX board's NVSwitch), "one of four ConnectX-6 HCAs" per GPU
    # for GPUDirect RDMA: 4 x 200 Gb/s HDR per node [HDR rate assumed for ConnectX-6]
    "supermicro-a100-40": NodeSpec("A100 40GB", 40 * GB, 4 * 200 * Gbit,
                                   note="GPT-NeoX-20B's servers: 8 x A100 40GB SXM4, NVSwitch, "
                                        "4 x 200 Gb/s HDR (ConnectX-6)"),
}


def node_preset(name: str) -> NodeSpec:
    """The node called ``name`` (case-insensitive; ``_`` and ``-`` alike), or a ValueError
    listing the names there are."""
    key = name.strip().lower().replace("_", "-")
    aliases = {"a100": "a100-40", "v100": "v100-32", "h100-sxm": "h100", "a100-sxm": "a100-40"}
    key = aliases.get(key, key)
    if key not in NODE_PRESETS:
        raise ValueError(f"unknown GPU or machine {name!r} for Cluster.preset; choose from "
                         f"{', '.join(sorted(NODE_PRESETS))}")
    return NODE_PRESETS[key]


def lookup(device_name: str) -> GpuSpec | None:
    """The spec of the GPU called ``device_name``, or None for an unknown one."""
    for pattern, spec in KNOWN_GPUS:
        if re.search(pattern, device_name):
            return spec
    for _, spec in KNOWN_GPUS:        # a spec's own name ("V100 16GB", "H100 SXM")
        if spec.name == device_name:
            return spec
    return None


def peaks_by_dtype(spec: GpuSpec, *, allow_tf32: bool) -> tuple[tuple[str, float], ...]:
    """Reachable matmul flop/s per dtype: ``spec.matmul_efficiency`` of the tensor-core
    peaks (``MATMUL_EFFICIENCY``, Hopper's ``HOPPER_MATMUL_EFFICIENCY``),
    ``FP32_MATMUL_EFFICIENCY`` of the CUDA cores' fp32 peak.

    float32 matmuls use tensor cores only when TF32 is allowed
    (``torch.set_float32_matmul_precision("high")``)."""
    tensor = spec.matmul_efficiency
    fp32 = spec.tf32 * tensor if allow_tf32 else spec.fp32 * FP32_MATMUL_EFFICIENCY
    fp16 = spec.fp16 or spec.bf16
    peaks = [("float32", fp32), ("bfloat16", spec.bf16 * tensor), ("float16", fp16 * tensor)]
    if spec.tf32 > spec.fp32:     # float32 convolutions: cuDNN allows TF32 by default
        peaks.append(("tf32", spec.tf32 * tensor))
    return tuple(peaks)


SFU_PER_CLOCK = 16
"""Results per clock per SM of the special-function units (``exp2``, ``rsqrt``, ...): the
CUDA C++ Programming Guide's throughput of native arithmetic instructions, 16 on compute
capabilities 5.x to 9.0. H100 SXM: 132 SMs x 16 x 1.98 GHz = 4.2e12 exponentials/s, next to
989 TFLOP/s of bf16 matmul (the FlashAttention-3 paper, Shah et al. 2024, quotes 3.9 TFLOPS
of special functions: at head dim 128 a fused attention's exponentials can take half as
long as its matmuls)."""


def exp_rate(spec: GpuSpec) -> float:
    """Exponentials per second one device computes (``SFU_PER_CLOCK`` per SM per clock at
    ``spec.boost_clock``); 0.0 where the clock is not listed (not modeled)."""
    return float(spec.multiprocessors * SFU_PER_CLOCK * spec.boost_clock)


def op_factors(spec: GpuSpec) -> tuple[tuple[str, float], ...]:
    """Op families whose kernels reach a fixed share of the dtype's matmul rate: fused
    attention (``spec.attention`` of the peak, a GEMM ``spec.matmul_efficiency`` of it)."""
    return (("sdpa", min(1.0, spec.attention / spec.matmul_efficiency)),
            ("convolution", CONVOLUTION_SHARE))


def usable_memory(sold: float) -> float:
    """Bytes a plan may use on a GPU sold with ``sold`` bytes (its "80GB" read as
    ``80 * GB``): what ``Cluster.detect`` finds on an idle card of that kind -- the sold
    figure is GiB of memory, of which CUDA reports ``DRIVER_VISIBLE``, less the CUDA
    context and the reserve ``detect`` keeps. So a plan made from a preset is refused where
    the same plan made on the card is, and not elsewhere: an "80GB" card plans with 77.3
    GiB (80e9 bytes, 74.5 GiB, before), a "16GB" one with 13.9 GiB (14.9 before)."""
    return sold / GB * 2**30 * DRIVER_VISIBLE - CUDA_CONTEXT_BYTES - DETECT_RESERVE_BYTES
