"""What a new user trips on: each bad input gets one error, raised where the input is
checked, naming the problem and what is accepted (never a TypeError from deep inside, a
search with nothing to weigh, or a setting silently replaced)."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tracing_guard import forbid_capture

import torchalpa
from torchalpa import AutoShardingOption, Cluster


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _batch(rows: int = 8):
    return torch.randn(rows, 16), torch.randn(rows, 16)


def _no_trace(monkeypatch):
    """Fail the test if the step is traced (by any module that calls ``capture_step``)."""
    forbid_capture(monkeypatch, "the step was traced before the input was refused")


@pytest.mark.parametrize("text, fix", [("16GB", "16e9 for 16 GB"),
                                       ("16GiB", "16 * 2**30 for 16 GiB"),
                                       ("lots", "16 * 2**30 for 16 GiB")])
def test_a_memory_size_written_as_text_says_the_number_to_write(text, fix):
    with pytest.raises(TypeError, match=r"AutoShardingOption.memory_budget_per_device must "
                       r"be a number of bytes.*" + fix.replace("*", r"\*")):
        AutoShardingOption(memory_budget_per_device=text)
    with pytest.raises(TypeError, match=r"Cluster.memory_per_device must be a number of "
                       r"bytes.*" + fix.replace("*", r"\*")):
        Cluster(num_nodes=1, devices_per_node=8, memory_per_device=text)


@pytest.mark.parametrize("budget", [0, -1])
def test_a_budget_of_no_bytes_is_refused_not_replaced_by_the_devices_memory(budget):
    """0 was taken as "not given" (the device's memory planned for instead), -1 refused
    by a bound deep in the search without naming the option."""
    with pytest.raises(ValueError, match=r"AutoShardingOption.memory_budget_per_device "
                       r"must be > 0 bytes, got " + str(budget)):
        AutoShardingOption(memory_budget_per_device=budget)
    assert AutoShardingOption(memory_budget_per_device=16 * 2 ** 30).memory_budget_per_device


def test_a_fraction_of_a_node_is_refused_when_the_cluster_is_made():
    """1.5 nodes passed the check (int(1.5) >= 1) and failed in planning with
    "'float' object cannot be interpreted as an integer"."""
    with pytest.raises(TypeError, match=r"Cluster.num_nodes must be an int, got 1.5"):
        Cluster.preset("h100", num_nodes=1.5)
    with pytest.raises(TypeError, match=r"Cluster.devices_per_node must be an int, got '8'"):
        Cluster(num_nodes=1, devices_per_node="8")
    with pytest.raises(ValueError, match=r"Cluster.num_nodes must be >= 1, got 0"):
        Cluster.preset("h100", num_nodes=0)


def test_pipeline_true_without_room_for_two_stages_is_refused_before_tracing(monkeypatch):
    """One device: no pipeline candidate and no intra-op one (pipeline=True rules those
    out): it was a search over nothing, an empty "tried:" list."""
    _no_trace(monkeypatch)
    with pytest.raises(ValueError, match=r"AutoParallel\(pipeline=True\) needs a pipeline "
                       r"of 2 or more stages: 2 or more devices, the cluster has 1"):
        torchalpa.plan(_mlp(), _batch(), F.mse_loss, cluster=Cluster.local_cpu(1),
                       method=torchalpa.AutoParallel(pipeline=True))


def test_a_pipeline_with_offload_is_refused_when_made():
    """The stage plans counted no optimizer states on the devices, the pipeline priced no
    host traffic and held no host memory: offload is planned for intra-op plans only."""
    offload = AutoShardingOption(offload=True)
    with pytest.raises(ValueError, match=r"PipeshardParallel cannot offload.*intra-op plans "
                       r"only.*ShardParallel\(auto_sharding_option=AutoShardingOption\("
                       r"offload=True\)\) or AutoParallel\(offload=True\)"):
        torchalpa.PipeshardParallel(auto_sharding_option=offload)
    with pytest.raises(ValueError, match="PipeshardParallel cannot offload"):
        torchalpa.PipeshardParallel(stage_option=torchalpa.ManualStageOption(
            forward_stage_layer_ids=((0,), (1,)), submesh_shapes=((1, 1), (1, 1)),
            options=(AutoShardingOption(), offload)))


def test_an_empty_batch_is_refused_before_tracing():
    """It was a CaptureError around a ZeroDivisionError inside a Linear."""
    x, y = _batch(0)
    with pytest.raises(ValueError, match=r"example_inputs\[0\] has an empty batch \(shape "
                       r"\(0, 16\)\): give at least one example"):
        torchalpa.plan(_mlp(), (x, y), F.mse_loss, cluster=Cluster.local_cpu(2))


def test_a_plain_function_as_the_model_says_it_is_not_a_module():
    with pytest.raises(ValueError, match=r"model is a function, not an nn.Module, so it is "
                       r"read as a JAX function .* or give a torch nn.Module"):
        torchalpa.plan(lambda x: x, _batch(), F.mse_loss, cluster=Cluster.local_cpu(2))


def test_a_shape_as_the_mesh_says_to_pass_a_device_mesh_or_a_logical_shape(
        single_process_world):
    """It was "'tuple' object has no attribute 'size'" from inside the method's steps."""
    with pytest.raises(TypeError, match=r"mesh must be a torch DeviceMesh over every rank .*"
                       r"got tuple \(4,\); .*ShardParallel\(logical_mesh_shape=...\)"):
        torchalpa.auto_parallel(_mlp(), _batch(), F.mse_loss, mesh=(4,))


def test_meta_inputs_to_a_built_module_are_refused_by_the_input_check(single_process_world):
    """Shape and dtype matched, then copying them to the device failed inside torch."""
    pm = torchalpa.auto_parallel(_mlp(), _batch(), F.mse_loss)
    x, y = (t.to("meta") for t in _batch())
    with pytest.raises(ValueError, match=r"input 0 is on the meta device, which holds no "
                       r"values to run: pass real tensors"):
        pm(x, y)
    assert pm(*_batch()).shape == ()


def test_a_loss_fn_that_is_not_callable_is_named():
    """It was a CaptureError "'str' object is not callable" with a hint about forward."""
    with pytest.raises(TypeError, match=r"loss_fn must be a function loss_fn\(outputs, "
                       r"\*targets\) .* got str 'mse'"):
        torchalpa.plan(_mlp(), _batch(), "mse", cluster=Cluster.local_cpu(2))


def test_integer_features_are_refused_by_the_default_method_too():
    """The default method planned a Linear fed int64 features without a word (the step
    fails on its first call); a concrete method refused it already. The search checks its
    first capture, before any candidate is bounded or solved."""
    x, y = torch.ones(8, 16, dtype=torch.long), torch.randn(8, 16)
    for method in (None, torchalpa.ShardParallel()):
        with pytest.raises(TypeError, match=r"multiplies operands of different dtypes .* "
                           r"float features"):
            torchalpa.plan(_mlp(), (x, y), F.mse_loss, cluster=Cluster.local_cpu(2),
                           method=method)


def test_a_fake_kernels_refusal_is_one_capture_error_without_torchs_logged_traceback(
        capfd, caplog):
    """Torch logged the refusal as an ERROR with a traceback from inside its meta kernels
    before the CaptureError that says it in the user's terms."""
    from torchalpa.frontends.torch_export import CaptureError
    x, y = torch.randn(8, 17), torch.randn(8, 16)          # 17 features into Linear(16, 32)
    with pytest.raises(CaptureError, match=r"(?s)module '0' \(Linear\).*same reduction dim"):
        torchalpa.plan(_mlp(), (x, y), F.mse_loss, cluster=Cluster.local_cpu(2),
                       method=torchalpa.ShardParallel())
    err = capfd.readouterr().err
    assert "failed while attempting to run meta" not in err and "Traceback" not in err
    assert not [r for r in caplog.records if r.name.startswith("torch._subclasses")]
