"""Calibrating the cost model to the machine: the alpha-beta fit, the measured cluster, the
bucketed price of gradient reductions, and the plan a gloo-like cluster gets (planning
only: no timing here)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
from torchalpa.core.cluster import GRADIENT_BUCKET_BYTES, Cluster, LogicalMesh
from torchalpa.core.placement import Partial, Replicate
from torchalpa.core.plan import OUTPUT, OutputSlot, ReshardStep
from torchalpa.parallel.calibrate import Calibration, calibration_enabled, fit_alpha_beta
from torchalpa.parallel.workflow import default_cluster
from torchalpa.passes.pricing.cost import collective_cost, gradient_steps_cost, steps_cost
from torchalpa.runtime.rewrites.buckets import DEFAULT_BUCKET_BYTES

SIZES = (4, 64 * 1024, 1024 * 1024, 4 * 1024 * 1024)


def ring_all_reduce_s(alpha, beta, size, n):
    return alpha + beta * 2 * (n - 1) / n * size


@pytest.mark.parametrize("n", [2, 4, 8])
def test_fit_recovers_alpha_and_beta_of_exact_timings(n):
    alpha, beta = 2e-3, 1 / 0.3e9
    times = [ring_all_reduce_s(alpha, beta, b, n) for b in SIZES]
    fitted = fit_alpha_beta(SIZES, times, n)
    assert fitted == pytest.approx((alpha, beta), rel=1e-9)


def test_fit_weighs_small_sizes_so_noise_on_large_ones_keeps_alpha():
    alpha, beta, n = 1e-3, 1e-9, 4
    times = [ring_all_reduce_s(alpha, beta, b, n) for b in SIZES]
    times[-1] *= 1.2                        # 20% noise on the 4 MiB all-reduce
    fitted_alpha, fitted_beta = fit_alpha_beta(SIZES, times, n)
    assert fitted_alpha == pytest.approx(alpha, rel=0.05)
    assert fitted_beta == pytest.approx(beta, rel=0.25)


def test_a_negative_intercept_is_refitted_through_the_origin():
    n, beta = 4, 1e-9
    times = [beta * 2 * (n - 1) / n * b for b in SIZES]
    times[0] = times[0] / 10                # faster than bandwidth alone: no latency at all
    fitted_alpha, fitted_beta = fit_alpha_beta(SIZES, times, n)
    assert fitted_alpha == 0.0 and fitted_beta > 0


def test_fit_rejects_what_cannot_be_fitted():
    with pytest.raises(ValueError, match="two or more"):
        fit_alpha_beta([4], [1e-3], 4)
    with pytest.raises(ValueError, match="different sizes"):
        fit_alpha_beta([4, 4], [1e-3, 2e-3], 4)
    with pytest.raises(ValueError, match="n >= 2"):
        fit_alpha_beta(SIZES, [1e-3] * 4, 1)


def test_a_calibration_becomes_a_gloo_cluster_with_its_figures():
    c = Calibration(world_size=4, backend="gloo", cores=2, flops=12e9, memory_bandwidth=2e9,
                    op_s=5e-6, alpha=3e-3, beta=1 / 0.25e9).cluster()
    mesh = c.logical_mesh((4,))
    assert (c.num_devices, c.backend, c.peak_flops, c.kernel_launch_s) == (4, "gloo", 12e9, 5e-6)
    assert mesh.alpha == pytest.approx((3e-3,)) and mesh.beta == pytest.approx((1 / 0.25e9,))
    assert mesh.gradient_bucket_bytes == DEFAULT_BUCKET_BYTES


def test_calibration_switch(monkeypatch):
    monkeypatch.setenv("TORCHALPA_CALIBRATE", "0")
    assert not calibration_enabled()
    monkeypatch.setenv("TORCHALPA_CALIBRATE", "maybe")
    with pytest.raises(ValueError, match="TORCHALPA_CALIBRATE"):
        calibration_enabled()


def test_planning_without_ranks_keeps_the_fixed_cpu_figures():
    assert default_cluster(4) == Cluster.local_cpu(4)
    assert default_cluster(4, measure=True) == Cluster.local_cpu(4)   # no process group


def test_the_runtime_and_the_cost_model_agree_on_the_bucket_size():
    assert GRADIENT_BUCKET_BYTES == DEFAULT_BUCKET_BYTES


def test_a_gradient_all_reduce_pays_its_share_of_a_bucket_latency():
    mesh = LogicalMesh(shape=(4,), alpha=(1e-3,), beta=(1e-9,), gradient_bucket_bytes=1e6)
    reduce = ReshardStep(kind="all_reduce", axis=0, src=(Partial(),), dst=(Replicate(),),
                         bytes=250_000)
    whole = collective_cost(mesh, "all_reduce", 0, 250_000)
    assert steps_cost(mesh, [reduce]) == pytest.approx(whole)
    # a quarter of a bucket: a quarter of the latency, all of the bandwidth
    assert gradient_steps_cost(mesh, [reduce]) == pytest.approx(whole - 0.75e-3)
    alpa = dataclasses.replace(mesh, gradient_bucket_bytes=0.0)      # Alpa's accounting
    assert gradient_steps_cost(alpa, [reduce]) == pytest.approx(whole)


def normed_mlp(num_blocks=2, width=32, hidden=128):
    """Linear + LayerNorm blocks: many small parameters, like a transformer's."""
    layers: list[nn.Module] = []
    for _ in range(num_blocks):
        layers += [nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.ReLU(),
                   nn.Linear(hidden, width), nn.LayerNorm(width)]
    return nn.Sequential(*layers)


def gloo_like_cluster() -> Cluster:
    """Figures ``Cluster.measure()`` gave for 4 gloo ranks on this 2-core machine under
    load (all-reduce latency several ms, a few hundred MB/s)."""
    return Calibration(world_size=4, backend="gloo", cores=2, flops=10e9,
                       memory_bandwidth=0.5e9, op_s=3e-6, alpha=5e-3,
                       beta=1 / 0.3e9).cluster()


def test_a_gloo_like_cluster_gets_ddps_plan():
    """Many small parameters and a small batch: DDP (everything replicated, gradients
    bucketed) is what runs fastest on gloo (benchmarks/zoo_vs_ddp_fsdp.py); with each
    gradient paying a latency of its own, the search used to split layers instead."""
    torch.manual_seed(0)
    batch = (torch.randn(32, 32), torch.randn(32, 32))
    auto = torchalpa.plan(normed_mlp(), batch, F.mse_loss, cluster=gloo_like_cluster(),
                          method=torchalpa.ShardParallel())
    # DDP's plan: every parameter whole, the only collectives the gradients' (and the
    # scalar loss's) all-reduces
    assert all(p.placements == (Replicate(),) for p in auto.parameters)
    assert {c.kind for c in auto.collectives} == {"all_reduce"}
    assert {c.tensor for c in auto.collectives if c.phase == "forward"} <= {
        r.producer for r in auto.reshards if r.consumer == OUTPUT and r.slot == OutputSlot.loss()}


@pytest.mark.slow
def test_the_zoo_gpt_gets_ddps_plan_on_a_gloo_like_cluster():
    """The zoo's tiny GPT on 4 gloo ranks: DDP ran 2-6x faster than the plan local_cpu's
    guesses chose (layers split, activation collectives in forward and backward); with
    measured-like figures and bucketed gradients the search picks DDP's layouts."""
    import torchalpa.models as zoo
    w = zoo.tiny("gpt", batch_size=16).replace(dropout=0.0)
    torch.manual_seed(1)
    batch = tuple(w.example_inputs())
    plan = torchalpa.plan(w.build(), batch, w.loss_fn, cluster=gloo_like_cluster(),
                          method=torchalpa.ShardParallel())
    assert all(p.placements == (Replicate(),) for p in plan.parameters)
    assert {c.kind for c in plan.collectives} == {"all_reduce"}
