"""Calibrating compute to the machine: windows that count the time a rank waits for a core,
convolutions at their own measured rate, the latency a collective adds inside a step, and
the plans those figures give small CNNs (planning only, on synthetic figures: no timing of
this machine here)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
import torchalpa.parallel.calibrate as calibrate
from torchalpa.core.cluster import Cluster
from torchalpa.core.opgraph import OpNode, TensorSpec
from torchalpa.core.placement import Replicate
from torchalpa.frontends.opset import flop_count
from torchalpa.parallel.calibrate import Calibration, conv_flops, in_step_latency
from torchalpa.passes.pricing.cost import compute_cost, op_family, optimizer_cost


class FakeClock:
    """``time.perf_counter`` for a rank that computes 1 ms per call and, every 4th call,
    waits 4 ms more for a core another rank holds."""

    def __init__(self):
        self.now = 0.0
        self.calls = 0

    def __call__(self) -> float:
        return self.now

    def work(self) -> None:
        self.calls += 1
        self.now += 1e-3 + (4e-3 if self.calls % 4 == 0 else 0.0)


def test_a_window_counts_the_time_a_rank_waits_for_a_core(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(calibrate.time, "perf_counter", clock)
    per_call = calibrate._window_time(clock.work, window_s=0.04)
    # 16 ms per 4 calls: the wait is paid as a step pays it; single calls' median says 1 ms
    assert per_call == pytest.approx(2e-3, rel=0.1)


def test_a_collective_in_a_step_costs_what_it_adds_to_the_compute_around_it():
    assert in_step_latency(10e-3, 3e-3) == pytest.approx(7e-3)
    assert in_step_latency(2e-3, 3e-3) == 0.0      # noise: never a negative latency


def test_conv_flops_counts_forward_and_backward_as_the_cost_model_does():
    aten = torch.ops.aten
    batch, channels, size, kernel = 2, 4, 6, 3
    x, w = torch.randn(batch, channels, size, size), torch.randn(channels, channels, kernel, kernel)
    conv_args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    y = aten.convolution.default(*conv_args)
    back_args = (torch.randn_like(y), x, w, [0], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                 [True, True, False])
    grads = aten.convolution_backward.default(*back_args)
    counted = flop_count(aten.convolution.default, conv_args, {}, y) + \
        flop_count(aten.convolution_backward.default, back_args, {}, grads)
    assert conv_flops(batch, channels, size, kernel) == pytest.approx(counted)


@pytest.mark.parametrize("op, family", [
    ("aten.convolution.default", "convolution"),
    ("aten.convolution_backward.default", "convolution"),
    ("aten._convolution.default", "convolution"),
    ("stablehlo.convolution", "convolution"),
    ("aten.mm.default", "mm"),
])
def test_op_family(op, family):
    assert op_family(op) == family


def measured(**figures) -> Calibration:
    """A calibration with these figures, the rest like 4 loaded gloo ranks on 2 cores."""
    base = dict(world_size=4, backend="gloo", cores=2, flops=13e9, conv_flops=4e9,
                memory_bandwidth=0.8e9, op_s=25e-6, alpha=7e-3, beta=1 / 0.3e9)
    return Calibration({**base, **figures})


def node(op: str, flops: float) -> OpNode:
    return OpNode(name="n", op=op, outputs=(TensorSpec((8, 16, 16, 16), "float32"),),
                  flops=flops, bytes=0.0)


def test_convolutions_compute_at_their_measured_rate_and_matmuls_at_theirs():
    mesh = measured(flops=20e9, conv_flops=2e9).cluster().logical_mesh((4,))
    flops = 1e8
    for op, rate in (("aten.convolution.default", 2e9),
                     ("aten.convolution_backward.default", 2e9), ("aten.mm.default", 20e9)):
        assert compute_cost(mesh, node(op, flops), 1) == pytest.approx(25e-6 + flops / rate)
        assert compute_cost(mesh, node(op, flops), 4) == pytest.approx(25e-6 + flops / 4 / rate)


def test_the_optimizer_pays_per_tensor_and_moves_its_shards_once():
    mesh = measured(optimizer_tensor_s=4e-4, memory_bandwidth=1e9).cluster().logical_mesh((4,))
    shards = {"w1": 4096.0, "w2": 1024.0}           # bytes of each parameter on this device
    # Adam: parameter, gradient and 2 states read and written once
    expected = 2 * 4e-4 + 2 * (2 + 2) * 5120 / 1e9
    assert optimizer_cost(mesh, shards, optimizer_states=2) == pytest.approx(expected)
    alpa = measured().cluster().logical_mesh((4,))   # no optimizer figure: left out
    assert optimizer_cost(alpa, shards, optimizer_states=2) == 0.0


def test_a_mesh_rejects_a_rate_that_is_not_positive():
    with pytest.raises(ValueError, match=r"peak_flops_by_op\['convolution'\]"):
        Cluster(peak_flops_by_op=(("convolution", 0.0),))
    with pytest.raises(ValueError, match="optimizer_tensor_s must be >= 0"):
        Cluster(optimizer_tensor_s=-1.0)


def test_a_calibration_of_the_previous_version_is_measured_again(tmp_path):
    old = measured(version=1, torch=torch.__version__)
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert calibrate._load(path, 4, "gloo") is None
    path.write_text(json.dumps({**old, "version": calibrate._VERSION}))
    assert calibrate._load(path, 4, "gloo") == {**old, "version": calibrate._VERSION}


class SmallResNet(nn.Module):
    """Two residual blocks of 3x3 convolutions (no batch norm, whose synced statistics DDP
    does not compute), pooled into a linear classifier."""

    def __init__(self, channels: int = 8, classes: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(channels, channels, 3, padding=1)) for _ in range(2))
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        x = F.relu(self.stem(x))
        for block in self.blocks:
            x = F.relu(x + block(x))
        return self.head(x.mean(dim=(2, 3)))


def ddps_plan(plan) -> bool:
    """Every parameter whole, and the only collectives all-reduces of the gradients and,
    in forward, of the loss's scalar sum."""
    return all(p.placements == (Replicate(),) for p in plan.parameters) and \
        {c.kind for c in plan.collectives} == {"all_reduce"} and \
        all(c.bytes <= 8 for c in plan.collectives if c.phase == "forward")


def test_a_small_resnet_gets_ddps_plan_under_measured_figures():
    """Convolutions at the measured CPU rate and the in-step collective latency: splitting
    the batch and reducing the gradients in one bucket is cheapest, and the search finds
    it, at no more than the DataParallel method's estimate. This guards the choice; the
    same net also gets it with convolutions at the matmul rate (the next test shows the
    convolution rate reaching the estimate)."""
    torch.manual_seed(0)
    batch = (torch.randn(16, 3, 16, 16), torch.randint(0, 8, (16,)))
    plan = torchalpa.plan(SmallResNet(), batch, F.cross_entropy, cluster=measured().cluster(),
                          method=torchalpa.ShardParallel())
    assert ddps_plan(plan), plan.collectives
    dp = torchalpa.plan(SmallResNet(), batch, F.cross_entropy, cluster=measured().cluster(),
                        method=torchalpa.DataParallel())
    assert plan.estimates["step_time_s"] <= dp.estimates["step_time_s"] * (1 + 1e-9)


def test_a_small_resnets_estimate_pays_its_convolutions_at_the_measured_rate():
    """Slowing convolutions from the matmul rate to the measured one adds, per device, the
    four block convolutions' flops (forward and both gradients) at the difference of the
    two rates, plus at most the stem's (forward and weight gradient): the whole-model
    estimate prices each convolution at the convolution rate, not one average rate."""
    torch.manual_seed(0)
    batch = (torch.randn(16, 3, 16, 16), torch.randint(0, 8, (16,)))
    fast, slow = 13e9, 4e9
    steps = []
    for rate in (fast, slow):
        plan = torchalpa.plan(SmallResNet(), batch, F.cross_entropy,
                              cluster=measured(conv_flops=rate).cluster(),
                              method=torchalpa.ShardParallel())
        assert ddps_plan(plan), plan.collectives
        steps.append(plan.estimates["step_time_s"])
    per_flop = 1 / slow - 1 / fast
    local_batch, channels, size, kernel = 16 // 4, 8, 16, 3
    blocks = 4 * conv_flops(local_batch, channels, size, kernel) * per_flop
    stem = 2 * 2 * local_batch * 3 * channels * kernel * kernel * size * size * per_flop
    assert blocks <= steps[1] - steps[0] <= blocks + stem


def test_measuring_leaves_the_callers_random_state_as_it_was(monkeypatch):
    """The first ``auto_parallel`` on a machine measures it; that must not reseed the
    user's generator (it made every rank's state equal, hiding per-rank seeds). One rank
    times everything as many do; only the alpha-beta fit, which needs two, is stubbed."""
    import torch.distributed as dist
    monkeypatch.setattr(calibrate, "fit_alpha_beta", lambda sizes, times, world: (1e-5, 1e-9))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(1234)
        expected = torch.rand(4)
        torch.manual_seed(1234)
        calibrate._measure_here(1, "gloo")
        assert torch.equal(torch.rand(4), expected)
    finally:
        dist.destroy_process_group()
