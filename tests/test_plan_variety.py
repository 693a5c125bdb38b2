"""Plans we did not choose, run: each model planned on a 2 x 2 mesh under several cost
settings (tests/plan_variety_worker.py), so the ILP picks data parallel, Megatron-like and
mixed layouts, and each plan's step runs on 4 gloo ranks next to one device.

Found by it: the zoo LLaMA under unit costs failed at its first step ("view size is not
compatible with input tensor's size and stride"): CPU attention writes its output in a
memory order where the model's transpose-then-view is free on one device, but the block
a rank held after an all-gather is contiguous in the logical order. Views are now local
reshapes (``runtime/lowering/localize.py``).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import worker_io

MODELS = ["gpt", "llama", "bert", "vit", "moe", "resnet", "bertlayers"]
COSTS = ["alpa", "flipped", "unit", "cheap"]
# llama:unit, the scenario that found the bug above, runs in make test-all: its 2 x 2 ILP
# took 137 of this file's 250 s at load 20 (the two here 10 and 9 s). The bug is witnessed
# in make test by test_a_view_runs_on_a_block_without_the_strides_the_graph_saw below (the
# localized view on such a block, in one process; it fails with the same error under the
# view rewrite before the fix), and LLaMA's ops under every strategy on 2 devices by
# tests/test_rules.py::test_zoo_training_step_every_strategy[llama].
FAST = ("bertlayers:alpa", "gpt:alpa")
SLOW = tuple(f"{m}:{c}" for m, c in itertools.product(MODELS, COSTS) if f"{m}:{c}" not in FAST)


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    out = tmp_path_factory.mktemp("variety") / "fast.json"
    return worker_io.launch("plan_variety_worker.py", out, ",".join(FAST), nproc=4)


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    out = tmp_path_factory.mktemp("variety") / "slow.json"
    return worker_io.launch("plan_variety_worker.py", out, ",".join(SLOW), nproc=4,
                            timeout=1800)


def _check(results, name):
    assert results["world_size"] == 4
    r = worker_io.scenario(results, name)
    assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
    assert r["grad_diff"] < 1e-4, (r["worst"], r["grad_diff"])
    assert r["executed"] == r["planned"]


@pytest.mark.parametrize("name", FAST)
def test_plan_runs_like_one_device(fast, name):
    _check(fast, name)


def test_the_costs_give_other_plans(fast):
    """The scenarios are not one plan thrice: the settings split different parameters."""
    splits = {tuple(fast[n]["split"]) for n in FAST if "error" not in fast[n]}
    assert all(splits) and len(splits) == len(FAST)


def test_a_view_runs_on_a_block_without_the_strides_the_graph_saw():
    """What llama:unit found, in one process: the graph's transpose-then-view was free on
    one device (CPU attention's (B, H, S, D) output laid out as (B, S, H, D) in memory),
    while a rank's block, here its half of the batch as a gather leaves it (contiguous in
    the logical order), cannot be viewed so. The localized view is a reshape of the block
    and gives the rank's half of the one-device result."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torchalpa.core.placement import Shard
    from torchalpa.core.plan import NodeStrategy
    from torchalpa.runtime.lowering.localize import localize
    out = torch.randn(2, 3, 4, 8).transpose(1, 2)            # (B, H, S, D), strided as BSHD
    gm = make_fx(lambda o: o.transpose(1, 2).view(2, 3, 32))(out)
    view = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.view.default)
    block = out[1:].contiguous().transpose(1, 2)             # rank 1's half, as gathered
    with pytest.raises(RuntimeError, match="view size is not compatible"):
        block.view(1, 3, 32)                                 # the graph's view, as it was
    split = (Shard(0),)
    target, args, kwargs = localize(view, [block, [2, 3, 32]], {},
                                    NodeStrategy(view.name, (split,), (split,)), (2,),
                                    torch.device("cpu"), (1,))
    assert torch.equal(target(*args, **kwargs), out.transpose(1, 2).reshape(2, 3, 32)[1:])


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_more_plans_run_like_one_device(slow, name):
    _check(slow, name)
