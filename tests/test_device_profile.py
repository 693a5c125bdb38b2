"""``torchalpa calibrate``'s CPU-checkable parts: the profile's storage and validation,
how the planner plans with it, and the measuring code run on a CPU device with tiny
shapes (the figures mean nothing there; the code path is the GPU's)."""

from __future__ import annotations

import pytest
import torch

from torchalpa.core.cluster import GB, Cluster
from torchalpa.parallel.calibrate_cuda import measure_device
from torchalpa.parallel.device_profile import (
    DeviceProfile,
    apply_profile,
    attention_flops,
    load_profile,
    save_profile,
)
from torchalpa.parallel.workflow import calibrated, default_cluster


def _profile(name="NVIDIA H200", **changes) -> DeviceProfile:
    fields = dict(device_name=name, torch_version=torch.__version__,
                  matmul={"bfloat16": {"large": 700e12, "narrow": 400e12},
                          "float32": {"large": 55e12}, "tf32": {"large": 380e12}},
                  memory_bandwidth=4.3e12, op_s=8e-6, attention={"bfloat16": 350e12})
    return DeviceProfile(**{**fields, **changes})


def test_a_profile_round_trips_and_refuses_what_it_cannot_mean():
    p = _profile()
    assert DeviceProfile.from_json(p.to_json()) == p
    with pytest.raises(ValueError, match="version 0, this torchalpa reads version 1"):
        DeviceProfile.from_json(p.to_json().replace('"version": 1', '"version": 0'))
    with pytest.raises(ValueError, match=r"matmul\['bfloat16'\] has no 'large' rate"):
        _profile(matmul={"bfloat16": {"narrow": 1e12}})
    with pytest.raises(ValueError, match="op_s must be > 0"):
        _profile(op_s=0.0)


def test_profiles_are_stored_per_device_and_torch(tmp_path):
    path = save_profile(_profile(), root=tmp_path)
    assert path is not None and path.parent == tmp_path / "calibration"
    assert load_profile("NVIDIA H200", torch.__version__, root=tmp_path) == _profile()
    assert load_profile("NVIDIA H100 80GB HBM3", torch.__version__, root=tmp_path) is None
    assert load_profile("NVIDIA H200", "0.0", root=tmp_path) is None
    path.write_text("{not json")
    assert load_profile("NVIDIA H200", torch.__version__, root=tmp_path) is None   # logged


def test_the_planner_plans_with_the_measured_rates():
    preset = Cluster.preset("h200", 1, 1)
    c = apply_profile(preset, _profile())
    peaks = dict(c.peak_flops_by_dtype)
    assert (peaks["bfloat16"], peaks["float32"], c.peak_flops) == (700e12, 55e12, 700e12)
    assert (c.memory_bandwidth, c.kernel_launch_s) == (4.3e12, 8e-6)
    assert dict(c.op_rate_factors)["sdpa"] == pytest.approx(0.5)
    assert (c.memory_per_device, c.intra_node_bandwidth) == (preset.memory_per_device,
                                                             preset.intra_node_bandwidth)
    tf32 = apply_profile(preset, _profile(), allow_tf32=True)
    assert dict(tf32.peak_flops_by_dtype)["float32"] == 380e12


def test_default_cluster_reads_the_stored_profile_of_this_gpu(monkeypatch, tmp_path):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "TORCHALPA_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TORCHALPA_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (140 * GB, 150 * GB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i=0: 0)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda i=0: 1.0,
                        raising=False)
    before = default_cluster(1)
    assert dict(before.peak_flops_by_dtype)["bfloat16"] != 700e12
    assert calibrated(before) == before                      # nothing stored yet
    save_profile(_profile())
    after = default_cluster(1)
    assert dict(after.peak_flops_by_dtype)["bfloat16"] == 700e12
    assert after.kernel_launch_s == 8e-6 and after.name.endswith("calibrated")


def test_attention_flops_are_the_nine_products_the_cost_model_prices():
    assert attention_flops(1, 1, 4, 2) == 9 * 2 * 4 * 4 * 2


def test_measuring_runs_end_to_end_on_a_cpu_device():
    p = measure_device("cpu", shapes={"large": (64, 64, 64), "narrow": (64, 16, 16)},
                       attention_shape=(1, 2, 32, 16), copy_bytes=1 << 20, tiny_ops=50,
                       dtypes=("float32", "bfloat16"))
    assert p.device_name == "cpu" and set(p.matmul) == {"float32", "bfloat16"}
    assert set(p.matmul["float32"]) == {"large", "narrow"}
    assert all(r > 0 for rates in p.matmul.values() for r in rates.values())
    assert p.memory_bandwidth > 0 and p.op_s > 0 and p.attention["bfloat16"] > 0
    assert DeviceProfile.from_json(p.to_json()) == p
