"""A job no plan can fit is refused from its parameters alone, before tracing
(``torchalpa/parallel/states_floor.py``); one that barely fits is not."""

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tracing_guard import forbid_capture

import torchalpa
from torchalpa.core.options import AutoParallel
from torchalpa.frontends.torch_export import capture
from torchalpa.parallel import workflow
from torchalpa.parallel.auto import NothingFitsError
from torchalpa.parallel.states_floor import ModelStates, modes, states_refusal
from torchalpa.passes.pricing.bounds import step_profile

WIDTH = 256


def _mlp():
    """States far above activations (4 layers of 256 x 256, a batch of 2): the floor
    sits just below what a plan needs."""
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    batch = (torch.randn(2, WIDTH), torch.randn(2, WIDTH))
    return model, batch


def _cluster(memory: float, host: float = 1e12) -> torchalpa.Cluster:
    return dataclasses.replace(torchalpa.Cluster.local_cpu(2), memory_per_device=memory,
                               host_memory_per_node=host)


def _no_trace(monkeypatch):
    """Fail the test if anything traces the step (the floor must answer first)."""
    forbid_capture(monkeypatch, "the step was traced before the floor refused it")


def test_the_floor_counts_the_states_the_capture_holds():
    """The parameters' bytes times (parameter, gradient, states) equal the captured step's
    state bytes, plain and under a mixed-precision wrapper (float32 masters)."""
    model, batch = _mlp()
    graph = capture(model, batch, F.mse_loss).graph
    profile = step_profile(graph, torchalpa.Cluster.local_cpu(2), optimizer="adam")
    states = ModelStates.of(model, "adam")
    assert states.on_devices == profile.state_bytes
    wrapped = workflow.with_precision(model, torchalpa.MixedPrecision(
        param_dtype=torch.bfloat16))
    cast = capture(wrapped, batch, F.mse_loss).graph
    assert ModelStates.of(wrapped, "adam").on_devices == \
        step_profile(cast, torchalpa.Cluster.local_cpu(2), optimizer="adam").state_bytes
    frozen = nn.Linear(8, 8)
    frozen.weight.requires_grad_(False)
    assert ModelStates.of(frozen, "sgd").count == 8          # the bias alone is trained


def test_an_impossible_job_is_refused_before_tracing_with_what_would_fit(monkeypatch):
    model, batch = _mlp()
    states = ModelStates.of(model, "adam")
    memory = 0.99 * states.on_devices / 2              # just below the states over both
    _no_trace(monkeypatch)
    with pytest.raises(NothingFitsError) as error:
        torchalpa.plan(model, batch, F.mse_loss, cluster=_cluster(memory),
                       method=AutoParallel(offload=False))
    text = str(error.value)
    assert error.value.attempts == ()
    assert text.startswith("no way to run this step fits ")
    assert "checked before tracing the step" in text
    assert f"on the devices: needs at least {torchalpa.core.units.format_bytes(states.on_devices / 2)}" \
        in text
    assert "not weighed (AutoParallel(offload=False))" in text
    assert "what would fit: at least 3 devices of " in text        # 2 x 0.99 < 3 x 0.99
    # offloading weighed (the default) but the hosts too small: both ways listed
    with pytest.raises(NothingFitsError) as error:
        torchalpa.plan(model, batch, F.mse_loss, cluster=_cluster(memory, host=1e5))
    text = str(error.value)
    assert "  on the devices: needs at least" in text
    assert "  optimizer states in host memory: needs at least" in text
    assert "  parameters, gradients and optimizer states in host memory: needs at least" \
        in text
    assert "hosts with at least" in text


def test_a_barely_fitting_job_is_not_refused_and_plans():
    """The ZeRO-3 plan's own peak as the budget: a plan fits (that one), so the floor
    must leave it to the search, which finds one."""
    model, batch = _mlp()
    with torch.device("meta"):
        meta = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    zero3 = torchalpa.plan(model, batch, F.mse_loss, cluster=_cluster(1e12),
                           method=torchalpa.Zero3Parallel(logical_mesh_shape=(2,)))
    peak = zero3.estimates.memory_per_device_bytes
    floor = ModelStates.of(model, "adam").on_devices / 2
    assert floor <= peak < 2 * floor             # the states are most of it
    method = AutoParallel(offload=False, pipeline=False)
    assert states_refusal(meta, method, _cluster(peak)) is None
    plan = torchalpa.plan(model, batch, F.mse_loss, cluster=_cluster(peak), method=method)
    assert plan.estimates.memory_per_device_bytes <= peak * (1 + 1e-9)


def test_hosts_barely_holding_the_offloaded_states_are_not_refused(monkeypatch):
    """Everything offloaded onto hosts of exactly what a plan needs there: that plan fits,
    so no refusal, and the search finds it; hosts a byte below the floor (what every
    plan needs at least, the search's own host check) are refused untraced."""
    model, batch = _mlp()
    floor = ModelStates.of(model, "adam").on_host(1, True)
    method = AutoParallel(offload="parameters", pipeline=False, remat=("none",),
                          num_micro_batches=1)
    roomy = torchalpa.plan(model, batch, F.mse_loss, cluster=_cluster(1e9), method=method)
    need = roomy.estimates.host_bytes_per_node
    assert floor <= need
    plan = torchalpa.plan(model, batch, F.mse_loss, cluster=_cluster(1e9, host=need),
                          method=method)
    assert plan.method["offload_parameters"]
    assert plan.estimates.host_bytes_per_node <= need
    _no_trace(monkeypatch)
    with pytest.raises(NothingFitsError, match="checked before tracing the step"):
        torchalpa.plan(model, batch, F.mse_loss, cluster=_cluster(1e9, host=floor - 1),
                       method=method)


def test_the_floor_is_below_every_plan():
    """Whatever the method, a plan's peak per device is at least the floor's."""
    model, batch = _mlp()
    floor = ModelStates.of(model, "adam").on_devices / 2
    for method in (torchalpa.ShardParallel(), torchalpa.DataParallel(),
                   torchalpa.Zero2Parallel(), torchalpa.Zero3Parallel()):
        plan = torchalpa.plan(model, batch, F.mse_loss, cluster=_cluster(1e12), method=method)
        assert plan.estimates.memory_per_device_bytes >= floor * (1 - 1e-9), method


def test_offloading_that_fits_the_hosts_is_left_to_the_search():
    """Devices far too small, hosts large: offloading may fit, so no refusal; with the
    method fixing offload to the optimizer states, the devices' share still counts."""
    model, _ = _mlp()
    states = ModelStates.of(model, "adam")
    tiny = _cluster(1e3)
    assert states_refusal(model, AutoParallel(), tiny) is None
    assert states_refusal(model, AutoParallel(offload="parameters"), tiny) is None
    refused = states_refusal(model, AutoParallel(offload=True), tiny)
    assert refused is not None and "(parameters and gradients)" in refused
    assert states_refusal(model, AutoParallel(offload=True),
                          _cluster(states.bytes)) is None       # 2 x bytes over 2 devices


_PRECISIONS = {
    "float32": (torch.float32, None),
    "bfloat16 parameters": (torch.bfloat16, None),
    "bf16 compute": (torch.float32, torchalpa.MixedPrecision(param_dtype=torch.bfloat16)),
    "bf16 compute, bf16 gradient sums": (torch.float32, torchalpa.MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
    "fp16 compute, fp16 gradient sums": (torch.float32, torchalpa.MixedPrecision(
        param_dtype=torch.float16, reduce_dtype=torch.float16)),
    "bfloat16 parameters, bf16 gradient sums": (torch.bfloat16, torchalpa.MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)),
}


@pytest.mark.parametrize("precision", list(_PRECISIONS))
def test_the_floor_never_exceeds_what_a_plan_counts_whatever_the_dtypes(precision):
    """Each way of holding the states (on the devices; optimizer states offloaded;
    everything offloaded) needs no more, by the floor, than the plans made that way count
    in their estimates -- on the devices and on the host -- whatever the parameters'
    dtype and the gradients' (mixed precision narrowing the compute or the gradient sums;
    the floor reads the stored parameters, the estimate the captured step)."""
    dtype, policy = _PRECISIONS[precision]
    model, batch = _mlp()
    model = model.to(dtype)
    batch = tuple(torch.cat([t, t]).to(dtype) for t in batch)     # 2 micro-batches of 2
    cluster = _cluster(1e12)
    precision_kw = {} if policy is None else {"mixed_precision": policy}
    states = ModelStates.of(model, "adam")
    methods = [(AutoParallel(offload=False), torchalpa.Zero3Parallel(num_micro_batches=k))
               for k in (1, 2)]
    methods += [(AutoParallel(offload=offload), AutoParallel(
        offload=offload, pipeline=False, remat=("none",), num_micro_batches=k))
        for offload in (True, "parameters") for k in (1, 2)]
    for floor_method, method in methods:
        (mode,) = modes(states, floor_method, cluster, 1e12)
        plan = torchalpa.plan(model, batch, F.mse_loss, cluster=cluster, method=method,
                              **precision_kw)
        est = plan.estimates
        counted = {"device": est.memory_per_device_bytes, "node": est.host_bytes_per_node,
                   "host": est.host_bytes_per_node}
        for where, need, _ in mode.needs:
            kind = "device" if "device" in where else "node" if "node" in where else "host"
            assert need <= counted[kind] * (1 + 1e-9), (precision, mode.name, where, method)
