"""Plans an expert writes by hand: checkpointing only some blocks ('full:k', chosen under
the memory budget) and optimizer states offloaded to host memory when nothing fits.

Planning runs in this process (tiny GPT, 4 blocks, on ``Cluster.local_cpu(2)``); training
on 2 real gloo ranks against one device runs tests/expert_plans_worker.py."""

from __future__ import annotations

import dataclasses

import pytest
import worker_io

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.options import parse_remat
from torchalpa.core.units import format_bytes
from torchalpa.parallel.auto import NothingFitsError
from torchalpa.passes.sharding.layer_remat import block_counts, checkpointing_line, more_recompute

BUDGET = 1.28e6   # between checkpointing every block (~1.23-1.25 MB) and the least plan without (~1.31 MB)
FIXED = dict(pipeline=False, num_micro_batches=1, rematerialize_parameters=False)


# -- the pieces ------------------------------------------------------------------------
def test_block_counts_start_at_the_fewest_blocks_whose_bound_fits():
    # 12 blocks each freeing 10 bytes: 130 over a budget of 100 needs 3 of them
    assert block_counts(12, 130.0, 10.0, 100.0)[0] == 3
    assert all(3 <= k < 12 for k in block_counts(12, 130.0, 10.0, 100.0))
    assert block_counts(12, 130.0, 110.0, 100.0) == []     # not even every block fits
    assert block_counts(1, 130.0, 10.0, 100.0) == []       # nothing in between


def test_the_summary_line_names_the_checkpointed_blocks():
    assert checkpointing_line("full:5", {"of": 12}) == \
        "checkpointing: blocks 0-4 of 12 (full), 5-11 none"
    assert checkpointing_line("full", {"of": 12}) == "checkpointing: blocks 0-11 of 12 (full)"
    assert checkpointing_line("none", {}).startswith("checkpointing: none")


def test_more_recompute_orders_modes_by_policy_and_blocks():
    assert more_recompute("none", "full:1") and more_recompute("full:2", "full:3")
    assert more_recompute("full:3", "full") and more_recompute("selective", "full")
    assert not more_recompute("full:3", "full:2") and not more_recompute("full", "selective")


def test_bad_block_counts_are_refused_with_the_accepted_forms():
    assert parse_remat("full:5") == ("full", 5) and parse_remat("none") == ("none", None)
    with pytest.raises(ValueError, match=r"'full:K' / 'selective:K'"):
        torchalpa.AutoShardingOption(remat="none:3")
    with pytest.raises(ValueError, match=r"must be an int >= 0"):
        torchalpa.AutoShardingOption(remat="full:x")
    with pytest.raises(ValueError, match=r"AutoParallel.remat must be modes among"):
        torchalpa.AutoParallel(remat=("auto",))
    with pytest.raises(ValueError, match=r"AutoParallel.offload must be True, False, None or "
                                         r"'parameters'"):
        torchalpa.AutoParallel(offload="yes")
    with pytest.raises(ValueError, match=r"offload_parameters needs offload=True .* set both"):
        torchalpa.AutoShardingOption(offload_parameters=True)
    with pytest.raises(ValueError, match=r"set AutoParallel\(offload=True\)"):
        torchalpa.AutoParallel(auto_sharding_option=torchalpa.AutoShardingOption(offload=True))


def test_presets_state_their_host_link_and_memory():
    h100, a100 = torchalpa.Cluster.h100(1, 1), torchalpa.Cluster.a100(1, 1)
    assert h100.host_link_bandwidth == pytest.approx(55e9)      # PCIe Gen5 x16
    assert a100.host_link_bandwidth == pytest.approx(25e9)      # PCIe Gen4 x16
    assert h100.host_memory_per_node > a100.host_memory_per_node > 0
    with pytest.raises(ValueError, match="host_link_bandwidth must be > 0"):
        torchalpa.Cluster(host_link_bandwidth=0)


# -- planning ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt():
    return zoo.tiny("gpt", batch_size=8, dropout=0.0, num_layers=4)


def _plan(gpt, cluster=None, **method):
    return torchalpa.plan(gpt.build(), gpt.example_inputs(), gpt.loss_fn,
                          cluster=cluster or torchalpa.Cluster.local_cpu(2),
                          method=torchalpa.AutoParallel(**method))


def _tight(budget=BUDGET):
    return torchalpa.AutoShardingOption(parameters="replicated",
                                        memory_budget_per_device=budget)


@pytest.fixture(scope="module")
def layered(gpt):
    return _plan(gpt, remat=("none", "full", "layers"), auto_sharding_option=_tight(), **FIXED)


@pytest.mark.slow      # a search of several solves (~20-30 s)
def test_a_tight_budget_checkpoints_some_blocks_and_beats_both_uniform_choices(gpt, layered):
    policy, k = parse_remat(layered.method["remat"])
    assert policy == "full" and 0 < k < 4, layered.method
    full = _plan(gpt, remat=("full",), auto_sharding_option=_tight(), **FIXED)
    assert layered.estimates.step_time_s < full.estimates.step_time_s
    assert layered.estimates.memory_per_device_bytes <= BUDGET
    with pytest.raises(NothingFitsError):        # keeping every block's activations
        _plan(gpt, remat=("none",), offload=False, auto_sharding_option=_tight(), **FIXED)


@pytest.mark.slow      # a search of several solves (~20-30 s)
def test_the_block_choice_shows_in_summary_and_explain_and_round_trips(layered):
    k = parse_remat(layered.method["remat"])[1]
    line = f"blocks 0-{k - 1} of 4 (full), {k}-3 none"
    assert line in layered.summary()
    assert line in layered.explain("checkpointing")
    again = torchalpa.Plan.from_json(layered.to_json())
    assert again.method["remat"] == layered.method["remat"]
    assert torchalpa.core.options.method_of_plan(again).auto_sharding_option.remat == \
        layered.method["remat"]


def test_offload_is_chosen_only_when_nothing_fits_on_the_devices(gpt):
    # optimizer states take half the model states: below what checkpointing reaches
    plan = _plan(gpt, remat=("none", "full"), auto_sharding_option=_tight(1.0e6), **FIXED)
    assert plan.method["offload"] is True
    est = plan.estimates
    assert est.offload_s > 0 and est.host_bytes_per_node > 0
    assert est.memory_per_device_bytes <= 1.0e6
    assert "offload: optimizer states in host memory" in plan.summary()
    assert "of host memory per node" in plan.explain("offload")
    again = torchalpa.Plan.from_json(plan.to_json())
    assert again.method["offload"] and again.estimates.offload_s == est.offload_s
    roomy = _plan(gpt, remat=("none",), **FIXED)
    assert not roomy.method.get("offload") and roomy.estimates.offload_s is None
    assert roomy.explain("offload").startswith("offload: none")


def test_offload_without_host_memory_is_refused_in_one_line(gpt):
    small = dataclasses.replace(torchalpa.Cluster.local_cpu(2), host_memory_per_node=1e5)
    with pytest.raises(NothingFitsError) as e:
        _plan(gpt, small, remat=("none", "full"), auto_sharding_option=_tight(1.0e6), **FIXED)
    message = str(e.value)
    assert "\n" not in message
    assert "offloading the optimizer states to host memory needs at least" in message
    assert "use hosts with" in message


def test_streamed_parameters_are_priced_per_phase_against_compute():
    from torchalpa.passes.pricing.offload_price import DEFAULT_HOST, _streamed_cost
    link = DEFAULT_HOST["host_link_bandwidth"]
    bare = _streamed_cost(1e9, 1e8, 2, None, 1, 1, step_s=0.0)
    # nothing to hide behind: forward's copies up, then backward's (up and down at once)
    assert bare.link_s == pytest.approx((2e9 + 3e8) / link)
    assert bare.link_bytes_per_device == 3e9 and bare.device_window_bytes == 3e8
    assert bare.host_bytes_per_device == 4e9       # parameters, gradients, two states
    busy = _streamed_cost(1e9, 1e8, 2, None, 1, 1, step_s=10.0)
    assert busy.link_s == pytest.approx(3e8 / link)  # only the first copies show
    assert _streamed_cost(1e9, 1e8, 2, None, 1, 2, step_s=0.0).link_bytes_per_device == 6e9
    # the search's floor (the link up, then the host's step) is below every such price
    for k in (1, 2, 4):
        for step_s in (0.0, 0.01, 0.05, 0.2, 1.0):
            cost = _streamed_cost(1e9, 1e8, 2, None, 1, k, step_s=step_s)
            floor = max(step_s, 2 * k * 1e9 / link) + cost.host_step_s
            assert step_s + cost.seconds >= floor - 1e-12


def test_a_parameter_offload_plan_holds_no_model_state_on_the_devices(gpt):
    plan = _plan(gpt, remat=("none",), offload="parameters", pipeline=False, num_micro_batches=1)
    est = plan.estimates
    assert plan.method["offload"] and plan.method["offload_parameters"]
    assert est.model_state_bytes_per_device == 0 and est.offload_s > 0
    plain = _plan(gpt, remat=("none",), offload=False, pipeline=False, num_micro_batches=1)
    assert est.memory_per_device_bytes < plain.estimates.memory_per_device_bytes
    line = "offload: parameters, gradients and optimizer states in host memory"
    assert line in plan.summary() and plan.explain("offload").startswith(line)
    again = torchalpa.Plan.from_json(plan.to_json())
    assert again.method["offload_parameters"]
    option = torchalpa.core.options.method_of_plan(again).auto_sharding_option
    assert option.offload_parameters and option.rematerialize_parameters


def test_parameters_are_offloaded_when_offloading_states_does_not_fit(gpt):
    plan = _plan(gpt, remat=("none",), auto_sharding_option=_tight(0.8e6), pipeline=False,
                 num_micro_batches=1)
    assert plan.method["offload_parameters"], plan.notes
    est = plan.estimates
    assert est.memory_per_device_bytes <= 0.8e6
    # the budget shown is the one asked for, the copies in flight counted in both it and
    # the peak; the host's bytes are said apart, not in the device's figure
    assert est.memory_budget_per_device_bytes == 0.8e6
    assert 0 < est.streamed_bytes_per_device < est.memory_per_device_bytes
    line = plan.summary().splitlines()[1]
    assert "of 781.2 KiB (states 0 B" in line and "OVER" not in line
    assert "copies in flight " + format_bytes(est.streamed_bytes_per_device) in line
    assert line.endswith(f"; host memory per node {format_bytes(est.host_bytes_per_node)} "
                         "(offloaded)")
    assert any(n.startswith("AutoParallel offloaded parameters, gradients and optimizer "
                            "states to host memory: without it,") for n in plan.notes)


def test_a_budget_the_copies_in_flight_exhaust_is_said_without_a_negative_amount(gpt):
    with pytest.raises(NothingFitsError) as e:
        _plan(gpt, remat=("none",), offload="parameters", pipeline=False, num_micro_batches=1,
              auto_sharding_option=torchalpa.AutoShardingOption(memory_budget_per_device=1e4))
    first = str(e.value).splitlines()[0]
    assert first.startswith("no way to run this step fits 9.8 KiB per device (") and \
        "of it kept for the offloaded parameters' copies in flight)" in first
    assert "-" not in first.split(" on ")[0]


def test_a_summary_says_when_a_peak_is_over_its_budget(gpt):
    plan = _plan(gpt, remat=("none",), offload=False, pipeline=False, num_micro_batches=1)
    est = plan.estimates
    over = dataclasses.replace(plan, estimates=dataclasses.replace(
        est, memory_budget_per_device_bytes=est.memory_per_device_bytes - 2048))
    assert "2.0 KiB OVER the device budget" in over.summary()
    assert "OVER" not in plan.summary() and "host memory per node" not in plan.summary()


def test_parameter_offload_without_host_memory_is_refused_before_tracing(gpt):
    """``offload='parameters'`` on hosts that cannot hold the states: the states' floor
    refuses it from the parameters alone (``states_floor``), saying what it needs."""
    small = dataclasses.replace(torchalpa.Cluster.local_cpu(2), host_memory_per_node=1e5)
    with pytest.raises(NothingFitsError) as e:
        _plan(gpt, small, remat=("none",), offload="parameters", pipeline=False,
              num_micro_batches=1)
    message = str(e.value)
    assert "checked before tracing the step" in message
    assert "  parameters, gradients and optimizer states in host memory: needs at least " \
        in message and "on the devices" not in message
    assert "what would fit: parameters, gradients and optimizer states in host memory: " \
        "hosts with at least" in message


def test_parameters_streamed_on_one_device_train_to_the_bit_through_autograd():
    # pmodel(x).backward() and the optimizer's step, as a user writes them: the copies
    # change no number
    import torch
    gpt = zoo.tiny("gpt", batch_size=8, dropout=0.0, num_layers=2)
    torch.manual_seed(1234)
    batch = gpt.example_inputs()
    torch.manual_seed(0)
    model = gpt.build()
    torch.manual_seed(0)
    ref = gpt.build()
    pm = torchalpa.auto_parallel(model, batch, gpt.loss_fn,
                                 cluster=torchalpa.Cluster.local_cpu(1),
                                 method=torchalpa.AutoParallel(remat=("none",),
                                                               offload="parameters",
                                                               pipeline=False,
                                                               num_micro_batches=1),
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    assert pm.plan.method["offload_parameters"] and "to_host(" in pm.local_program()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for _ in range(3):
        loss = pm(*batch)
        loss.backward()
        pm.optimizer.step()
        pm.optimizer.zero_grad(set_to_none=True)
        want = gpt.loss_fn(ref(*batch[:-1]), batch[-1])
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        assert loss.item() == want.item()
    assert all(torch.equal(p.full_tensor(), q) for p, q in
               zip(pm.module.parameters(), ref.parameters()))


# -- training on 2 gloo ranks -----------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert") / "expert_plans.json"
    return worker_io.launch_checked("expert_plans_worker.py", out, nproc=2, timeout=900)


def _trains_like_one_device(r):
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert got == pytest.approx(want, rel=1e-5)
    assert r["max_param_diff"] < 1e-4


@pytest.mark.slow      # 2 gloo ranks plan and train (~50 s with the pool's start)
def test_some_blocks_checkpointed_train_like_one_device(trained):
    r = trained["layers"]
    policy, k = parse_remat(r["remat"])
    assert policy == "full" and 0 < k < 4
    _trains_like_one_device(r)


@pytest.mark.slow      # 2 gloo ranks plan and train (~50 s with the pool's start)
def test_offloaded_states_train_like_one_device_on_host_copies(trained):
    r = trained["offload"]
    assert r["offload"] and r["estimates"]["offload_s"] > 0
    assert r["host_copies"] > 0 and r["states_apart"]
    assert r["device_grads_left"] == 0           # gradients went to the host
    _trains_like_one_device(r)


@pytest.mark.slow      # 2 gloo ranks plan and train (~50 s with the pool's start)
def test_parameters_streamed_from_the_host_train_like_one_device(trained):
    r = trained["param_offload_1"]
    assert r["offload_parameters"] and r["stepped_in_place"]
    assert r["fetches"] > 0 and r["grads_to_host"] > 0      # device copies, gradients down
    assert r["device_grads_left"] == 0
    _trains_like_one_device(r)


@pytest.mark.slow      # 2 gloo ranks plan and train (~50 s with the pool's start)
def test_parameters_streamed_over_micro_batches_train_as_on_the_devices(trained):
    # two micro-batches round like the same plan kept on the devices, to the bit
    r, twin = trained["param_offload_2"], trained["plain_2"]
    assert r["offload_parameters"] and not twin["offload"]
    assert r["losses"] == twin["losses"] and r["max_param_diff"] == twin["max_param_diff"]
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert got == pytest.approx(want, rel=1e-5)


@pytest.mark.slow      # 2 gloo ranks plan and train (~50 s with the pool's start)
@pytest.mark.parametrize("offload", ["True", "parameters"])
def test_a_host_optimizer_checkpoint_resumes_to_the_bit(trained, offload):
    # DCP keys a host optimizer's states by the module's parameter names; a fresh run
    # (other initial weights) that loads the checkpoint continues as the first did
    r = trained[f"checkpoint_{offload}"]
    assert r["offload_parameters"] == (offload == "parameters")
    assert r["resumed"] == r["uninterrupted"][2:] and r["same_weights"]


@pytest.mark.slow      # 4 gloo ranks plan and train a pipeline (~60 s)
def test_a_pipeline_checkpointing_its_first_stage_only_trains_like_one_device(tmp_path):
    r = worker_io.launch_checked("expert_plans_worker.py", tmp_path / "expert_4.json", nproc=4,
                                 timeout=900)["pipeline_layers"]
    assert r["remat"] == "full:2"
    assert any("blocks 0-1 of 4 (full), 2-3 none" in n for n in r["notes"])
    _trains_like_one_device(r)


def test_a_pipeline_summary_says_which_stage_checkpoints_which_blocks(gpt):
    method = torchalpa.PipeshardParallel(
        num_micro_batches=2, layer_option=torchalpa.AutoLayerOption(layer_num=2),
        stage_option="uniform", auto_sharding_option=torchalpa.AutoShardingOption(remat="full:2"))
    plan = torchalpa.plan(gpt.build(), gpt.example_inputs(), gpt.loss_fn,
                          cluster=torchalpa.Cluster.local_cpu(4), method=method)
    assert plan.method["remat"] == "full:2"
    assert "checkpointing per stage: stage 0 blocks 0-1 (full); stage 1 none" in plan.summary()
    assert "blocks 0-1 of 4 (full), 2-3 none" in plan.explain("checkpointing")
