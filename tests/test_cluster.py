"""Cluster.detect() and the default cluster, with the CUDA queries faked on CPU; the
GPU table; the dtype-aware, launch-paying compute cost."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from models import MLP, mlp_inputs

import torchalpa
from torchalpa.core import gpu_specs
from torchalpa.core.cluster import GB, Cluster, LogicalMesh
from torchalpa.core.opgraph import GraphOutputs, OpGraph, OpNode, TensorSpec, ValueRef
from torchalpa.core.placement import Replicate, Shard
from torchalpa.parallel.workflow import default_cluster
from torchalpa.passes.pricing.cost import compute_cost, strategy_bytes


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA machine as torch.cuda reports it: name, free/total memory, reserved bytes."""
    def install(name="NVIDIA H100 80GB HBM3", free=70 * GB, total=85 * GB, reserved=5 * GB,
                count=8):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (free, total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i=0: reserved)
        monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i=0: 1.0,
                            raising=False)
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "TORCHALPA_DEVICE"):
        monkeypatch.delenv(var, raising=False)   # conftest.py sets TORCHALPA_DEVICE=cpu
    return install


@pytest.fixture
def fp32_precision():
    before = torch.get_float32_matmul_precision()
    yield torch.set_float32_matmul_precision
    torch.set_float32_matmul_precision(before)


def test_detect_reads_the_gpu_memory_and_launch_layout(fake_gpu, monkeypatch, fp32_precision):
    fake_gpu()
    fp32_precision("highest")
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    c = Cluster.detect()
    assert (c.num_nodes, c.devices_per_node, c.backend) == (2, 8, "nccl")
    assert c.device_name == "NVIDIA H100 80GB HBM3" and "H100 SXM" in c.name
    # free + what this process already reserved, less the reserve for context and NCCL
    assert c.memory_per_device == pytest.approx(75 * GB - 1.5 * GB)
    peaks = dict(c.peak_flops_by_dtype)
    assert peaks["bfloat16"] == pytest.approx(989e12 * gpu_specs.HOPPER_MATMUL_EFFICIENCY)
    assert peaks["float32"] == pytest.approx(67e12 * gpu_specs.FP32_MATMUL_EFFICIENCY)
    assert c.kernel_launch_s > 0
    fp32_precision("high")                   # TF32 allowed: float32 matmuls on tensor cores
    assert dict(Cluster.detect().peak_flops_by_dtype)["float32"] == pytest.approx(
        495e12 * gpu_specs.HOPPER_MATMUL_EFFICIENCY)


def test_detect_caps_memory_at_the_card_and_the_process_fraction(fake_gpu, monkeypatch):
    fake_gpu(free=40 * GB, total=40 * GB, reserved=10 * GB, name="NVIDIA A100-SXM4-40GB")
    assert Cluster.detect(1, 1).memory_per_device == pytest.approx(40 * GB - 1.5 * GB)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i=0: 0.5,
                        raising=False)
    assert Cluster.detect(1, 1).memory_per_device == pytest.approx(20 * GB - 1.5 * GB)


def test_detect_without_torchrun_takes_every_visible_gpu(fake_gpu):
    fake_gpu(count=4)
    c = Cluster.detect()
    assert (c.num_nodes, c.devices_per_node) == (1, 4)


def test_detect_warns_on_an_unknown_gpu(fake_gpu):
    fake_gpu(name="Imaginary GPU 9000")
    with pytest.warns(UserWarning, match="unknown GPU 'Imaginary GPU 9000'"):
        c = Cluster.detect(1, 1)
    assert c.device_name == "Imaginary GPU 9000"


def test_detect_on_cpu_is_local_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Cluster.detect() == Cluster.local_cpu(4)


def test_default_cluster_is_the_detected_gpu(fake_gpu, monkeypatch):
    fake_gpu(name="NVIDIA H200", total=150 * GB, free=140 * GB, reserved=0)
    c = default_cluster(1)
    assert (c.num_devices, c.device_name) == (1, "NVIDIA H200")
    assert c.memory_per_device == pytest.approx(140 * GB - 1.5 * GB)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert (default_cluster(16).num_nodes, default_cluster(16).devices_per_node) == (2, 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_cluster(2) == Cluster.local_cpu(2)


@pytest.mark.parametrize("reported, model", [
    ("NVIDIA H100 80GB HBM3", "H100 SXM"), ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA H100 NVL", "H100 NVL"), ("NVIDIA H200", "H200"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB"), ("NVIDIA A100-SXM4-80GB", "A100 80GB"),
    ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe"), ("NVIDIA A100-PCIE-40GB", "A100 40GB PCIe"),
    ("NVIDIA L4", "L4"), ("NVIDIA L40S", "L40S"), ("NVIDIA A10", "A10"), ("NVIDIA A10G", "A10G"),
    ("Tesla V100-SXM2-16GB", "V100 16GB"), ("Tesla V100-SXM2-32GB", "V100"),
    ("Tesla T4", "T4"), ("AMD Instinct MI300X", "MI300X"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"),
])
def test_known_gpus_by_their_reported_names(reported, model):
    assert gpu_specs.lookup(reported).name == model


def test_plan_summary_names_the_device_and_memory_budget():
    cluster = Cluster(devices_per_node=2, memory_per_device=12 * GB, backend="gloo",
                      device_name="NVIDIA L4")
    x, y = mlp_inputs(8, 16)
    plan = torchalpa.plan(MLP(16, 2), (x, y), F.mse_loss, cluster=cluster,
                          method=torchalpa.ShardParallel())
    assert "planned for NVIDIA L4 (gloo), memory budget 11.2 GiB per device" in plan.summary()
    assert plan.estimates.memory_budget_bytes == 12 * GB


# -- the compute cost -----------------------------------------------------------------

def _mm(dtype: str, n: int = 4096) -> OpNode:
    spec = TensorSpec((n, n), dtype)
    size = spec.nbytes
    return OpNode(name="mm", op="aten.mm.default", kind="op", outputs=(spec,),
                  flops=2.0 * n ** 3, bytes=3.0 * size)


def test_matmul_cost_uses_the_peak_of_its_dtype():
    mesh = LogicalMesh(shape=(1,), peak_flops=100e12, memory_bandwidth=2e12,
                       peak_flops_by_dtype={"bfloat16": 600e12, "float32": 40e12})
    bf16, fp32 = compute_cost(mesh, _mm("bfloat16"), 1), compute_cost(mesh, _mm("float32"), 1)
    assert bf16 == pytest.approx(2 * 4096 ** 3 / 600e12)
    assert fp32 == pytest.approx(2 * 4096 ** 3 / 40e12)
    assert compute_cost(mesh, _mm("float16"), 1) == pytest.approx(2 * 4096 ** 3 / 100e12)


def test_every_kernel_pays_its_launch_but_views_launch_none():
    mesh = LogicalMesh(shape=(2,), peak_flops=100e12, memory_bandwidth=2e12,
                       kernel_launch_s=5e-6, backend="gloo")
    tiny = _mm("float32", n=8)
    assert compute_cost(mesh, tiny, 2) == pytest.approx(5e-6 + tiny.flops / 2 / 100e12, rel=1e-3)
    view = OpNode(name="v", op="aten.view.default", kind="op", outputs=(TensorSpec((8,), "float32"),),
                  aliases=True)
    assert compute_cost(mesh, view, 1) == 0.0


def test_a_batch_split_matmul_still_reads_its_whole_weight():
    """A decode step's matmul (few rows, a large weight): splitting the rows two ways
    halves the activations each device moves but not the weight it reads; splitting the
    weight halves that."""
    x, w, y = TensorSpec((4, 1024), "float32"), TensorSpec((1024, 1024), "float32"), \
        TensorSpec((4, 1024), "float32")
    whole = float(x.nbytes + w.nbytes + y.nbytes)
    g = OpGraph([OpNode(name="x", op="input", kind="input", outputs=(x,)),
                 OpNode(name="w", op="param", kind="param", outputs=(w,), is_param=True),
                 OpNode(name="mm", op="aten.mm.default", operands=(ValueRef("x"), ValueRef("w")),
                        outputs=(y,), flops=2.0 * 4 * 1024 * 1024, bytes=whole)],
                GraphOutputs(loss=None, sends=(ValueRef("mm"),)))
    mm, R = g.node("mm"), (Replicate(),)
    assert strategy_bytes(g, mm, (R, R), (R,), (2,)) == whole
    rows = strategy_bytes(g, mm, ((Shard(0),), R), ((Shard(0),),), (2,))
    assert rows == pytest.approx(w.nbytes + (x.nbytes + y.nbytes) / 2)
    cols = strategy_bytes(g, mm, (R, (Shard(1),)), ((Shard(1),),), (2,))
    assert cols == pytest.approx(x.nbytes + (w.nbytes + y.nbytes) / 2)
    mesh = LogicalMesh(shape=(2,), peak_flops=100e12, memory_bandwidth=1e12)
    assert compute_cost(mesh, mm, 2, nbytes=rows) == pytest.approx(rows / 1e12)  # memory-bound
    assert compute_cost(mesh, mm, 2, nbytes=rows) > 1.9 * compute_cost(mesh, mm, 2, nbytes=cols)


def test_cluster_options_are_validated():
    with pytest.raises(ValueError, match="kernel_launch_s"):
        Cluster(kernel_launch_s=-1)
    with pytest.raises(ValueError, match=r"peak_flops_by_dtype\['bfloat16'\]"):
        Cluster(peak_flops_by_dtype={"bfloat16": 0})
    mesh = Cluster(peak_flops_by_dtype={torch.bfloat16: 1e12}, kernel_launch_s=1e-6,
                   device_name="X").logical_mesh()
    assert (mesh.peak_flops_for("bfloat16"), mesh.kernel_launch_s, mesh.device_name) == \
        (1e12, 1e-6, "X")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mesh.peak_flops_for("int64") == mesh.peak_flops


def test_torchalpa_device_cpu_keeps_a_gpu_machine_on_cpus_and_gloo(fake_gpu, monkeypatch):
    from torchalpa.core.cluster import cuda_selected
    from torchalpa.runtime.execution.mesh import default_backend, default_device
    fake_gpu(count=1)
    assert cuda_selected() and default_backend() == "nccl"
    monkeypatch.setenv("TORCHALPA_DEVICE", "cpu")
    assert not cuda_selected()
    assert (default_backend(), default_device().type) == ("gloo", "cpu")
    assert Cluster.detect(1, 4) == Cluster.local_cpu(4)
    monkeypatch.setenv("TORCHALPA_DEVICE", "tpu")
    with pytest.raises(ValueError, match="TORCHALPA_DEVICE must be 'cpu' or 'cuda'"):
        cuda_selected()


def test_torchalpa_device_cuda_without_cuda_says_how_to_fix_it(monkeypatch):
    from torchalpa.core.cluster import cuda_selected
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TORCHALPA_DEVICE", "cuda")
    with pytest.raises(RuntimeError, match="TORCHALPA_DEVICE=cuda, but .*unset TORCHALPA_DEVICE"):
        cuda_selected()


def test_more_ranks_than_gpus_is_refused_before_nccl(fake_gpu, monkeypatch):
    """Four ranks on a one-GPU machine: a clear error naming both ways out, not NCCL's
    refusal or an invalid device ordinal on rank 1."""
    from torchalpa.runtime.execution import mesh
    fake_gpu(count=1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(RuntimeError, match=r"4 ranks on this node but 1 CUDA device.*"
                                           r"--nproc_per_node=1.*TORCHALPA_DEVICE=cpu"):
        mesh._check_one_device_per_rank()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    mesh._check_one_device_per_rank()                 # one rank per GPU: fine
