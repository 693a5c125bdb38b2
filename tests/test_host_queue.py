"""The host and contention in the GPU step walk (passes/pricing/overlap_price.py): an eager
program's host issues every op, so a step of small kernels costs the host's time; compute
beside a collective runs ``contention`` times slower. Walks of hand-made ops, then plans of
tiny models."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
from torchalpa.passes.pricing.overlap_price import CommEvent, Device, overlapped_step

FWD, BWD = "forward", "backward"


def _step(kernels, host=(), contention=1.0, events=(), phases=None):
    phases = phases or [FWD] * len(kernels)
    return overlapped_step(list(kernels), phases, list(events), 25 * 2 ** 20,
                           Device(host_s=tuple(host), contention=contention))[0]


def test_a_step_of_tiny_kernels_costs_the_host_s_time():
    kernels = [1e-6] * 100
    host = [20e-6] * 100
    # the device waits on the host for every op: the last kernel ends right after its issue
    assert _step(kernels, host) == pytest.approx(sum(host) + kernels[-1])
    assert _step(kernels) == pytest.approx(sum(kernels))       # without the host


def test_more_ops_mean_more_host_time():
    assert _step([1e-6] * 200, [20e-6] * 200) > 1.9 * _step([1e-6] * 100, [20e-6] * 100)


def test_large_kernels_hide_the_host():
    # the host runs ahead of a busy device: only the first issue shows
    kernels = [1e-3] * 50
    assert _step(kernels, [20e-6] * 50) == pytest.approx(20e-6 + sum(kernels))


def test_host_and_device_overlap_as_a_queue():
    # a large kernel, then many small ones: the host issues the small ones while the
    # large one runs, so the step is not the sum of the two sides
    kernels = [1e-3] + [1e-6] * 40
    host = [20e-6] * 41
    step = _step(kernels, host)
    assert max(sum(kernels), sum(host)) <= step < sum(kernels) + sum(host)
    assert step == pytest.approx(max(20e-6 + 1e-3 + 40e-6, sum(host) + 1e-6))


def test_one_host_time_per_op_is_required():
    with pytest.raises(ValueError, match="host times"):
        _step([1.0, 1.0], [1.0])


def test_contention_slows_the_compute_that_overlaps_a_collective():
    # backward of 2 ops of 1 s; the first op's gradient (1 MiB, 0.5 s) is reduced while
    # the second computes
    grads = [CommEvent(0.5, 0, 0, "gradient", 2 ** 20, BWD, "all_reduce")]
    free = _step([1.0, 1.0], events=grads, phases=[BWD, BWD])
    assert free == pytest.approx(2.0)
    slowed = _step([1.0, 1.0], contention=1.5, events=grads, phases=[BWD, BWD])
    # 0.5 s beside the reduction does 0.5 / 1.5 s of the op's work; the rest at full speed
    assert slowed == pytest.approx(1.0 + 0.5 + (1.0 - 0.5 / 1.5))


def test_the_compute_a_hidden_collective_overlaps_takes_the_factor_longer():
    # backward ops of 1, 1 and 5 s; op 0's gradient reduced in 2 s while ops 1 and 2 run
    grads = [CommEvent(2.0, 0, 0, "gradient", 2 ** 20, BWD, "all_reduce")]
    kernels, phases = [1.0, 1.0, 5.0], [BWD] * 3
    free = _step(kernels, events=grads, phases=phases)
    assert free == pytest.approx(7.0)                          # hidden: free
    for f in (1.2, 1.35, 2.0):
        slowed = _step(kernels, contention=f, events=grads, phases=phases)
        # the 2 s beside the reduction do 2 / f s of compute: that work took f times as long
        assert slowed - free == pytest.approx(2.0 - 2.0 / f)
        assert slowed == pytest.approx(1.0 + f * (2.0 / f) + (6.0 - 2.0 / f))


def test_serial_collectives_see_no_contention():
    events = [CommEvent(2.0, 1, 0, "serial", kind="all_reduce")]
    assert _step([1.0] * 3, contention=1.5, events=events) == pytest.approx(5.0)


def _mlp(layers: int):
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(layers)])
        batch = (torch.randn(8, 64), torch.randn(8, 64))
    return model, batch


def _plan(layers: int, cluster, **kw):
    model, batch = _mlp(layers)
    return torchalpa.plan(model, batch, F.mse_loss, cluster=cluster, **kw)


def test_a_tiny_model_s_step_on_a_gpu_is_its_host_time():
    cluster = torchalpa.Cluster.preset("h100", 1, 1)
    assert cluster.host_op_s > 0
    small, large = _plan(2, cluster).estimates, _plan(8, cluster).estimates
    assert small.host_s and large.host_s and large.host_s > 3 * small.host_s
    for e in (small, large):   # host-bound: the step is the host's time and the optimizer
        assert e.host_s <= e.step_time_s <= e.host_s + e.once_per_step_s + 1e-5
    without = _plan(8, dataclasses.replace(cluster, host_op_s=0.0)).estimates
    assert without.host_s is None and without.step_time_s < large.step_time_s


def test_the_host_is_not_priced_for_fused_kernels_nor_on_cpu_ranks():
    cluster = torchalpa.Cluster.preset("h100", 1, 1)
    fused = torchalpa.ShardParallel(
        auto_sharding_option=torchalpa.AutoShardingOption(elementwise="fused"))
    assert _plan(4, cluster, method=fused).estimates.host_s is None
    cpu = dataclasses.replace(torchalpa.Cluster.local_cpu(1), host_op_s=20e-6)
    assert _plan(4, cpu).estimates.host_s is None


def test_a_compiled_step_is_priced_as_the_fused_kernels_it_issues():
    """auto_parallel(compile=True) runs the step under torch.compile: its host issues the
    fused kernels, not one per ATen op, so the plan is made with elementwise="fused" (no
    per-op host queue) where eager planning would be host-bound."""
    cluster = torchalpa.Cluster.preset("h100", 1, 1)
    batch = (torch.randn(8, 64), torch.randn(8, 64))
    plans = {c: torchalpa.auto_parallel(nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]),
                                        batch, F.mse_loss, cluster=cluster, compile=c,
                                        method=torchalpa.ShardParallel()).plan
             for c in (False, True)}
    assert plans[False].estimates.host_s
    assert plans[True].estimates.host_s is None
    assert plans[True].method["auto_sharding_option"]["elementwise"] == "fused"
    assert plans[True].estimates.step_time_s < plans[False].estimates.step_time_s


def test_contention_raises_a_data_parallel_step_whose_reductions_hide_behind_backward():
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)])
        batch = (torch.randn(4096, 2048), torch.randn(4096, 2048))
    base = dataclasses.replace(torchalpa.Cluster.preset("h100", 1, 4), host_op_s=0.0,
                               contention=1.0)
    method = torchalpa.DataParallel()
    free = torchalpa.plan(model, batch, F.mse_loss, cluster=base, method=method).estimates
    assert free.hidden_communication_s and free.hidden_communication_s > 0
    slowed = torchalpa.plan(model, batch, F.mse_loss, method=method,
                            cluster=dataclasses.replace(base, contention=1.5)).estimates
    assert free.step_time_s < slowed.step_time_s
    # at most the hidden part slowed by the factor
    assert slowed.step_time_s <= free.step_time_s + 0.5 * free.hidden_communication_s + 1e-9


def test_contention_below_one_is_refused():
    with pytest.raises(ValueError, match="contention must be >= 1.0"):
        torchalpa.Cluster(contention=0.5)
    with pytest.raises(ValueError, match="host_op_s must be >= 0"):
        torchalpa.Cluster(host_op_s=-1.0)
