"""Runtime features in a world of one process: gradient accumulation, mixed precision,
torch.compile, meta-device models, forward-only programs and their error messages.
(The same features on real gloo ranks: tests/test_runtime_dist.py.)"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from models import MLP, mlp_inputs

import torchalpa
from torchalpa.runtime.execution.materialize import MaterializeWarning
from torchalpa.runtime.execution.precision import CastForward, MixedPrecision
from torchalpa.runtime.state.checkpoint import load_checkpoint, save_checkpoint

pytestmark = pytest.mark.usefixtures("single_process_world")   # conftest.py


def twin(make):
    torch.manual_seed(0)
    a = make()
    torch.manual_seed(0)
    return a, make()


def adam(ps):
    return torch.optim.Adam(ps, lr=1e-3)


# -- gradient accumulation ----------------------------------------------------------------

def test_micro_batches_give_the_whole_batch_loss_and_gradients():
    model, ref = twin(lambda: MLP(32, 3))
    x, y = mlp_inputs(16, 32)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss, num_micro_batches=4,
                                 method=torchalpa.ShardParallel())
    assert pm.plan.inputs[0].shape == (4, 32)
    loss = pm(x, y)
    loss.backward()
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for p, q in zip(pm.parameters(), ref.parameters()):
        assert torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7)


def test_micro_batches_reduce_gradients_once_per_step():
    x, y = mlp_inputs(16, 32)
    pm = torchalpa.auto_parallel(MLP(32, 2), (x, y), F.mse_loss, num_micro_batches=4,
                                 optimizer=adam, method=torchalpa.ShardParallel())
    program = pm._runner.program         # train_step's pair of programs, counted
    calls = {"forward": 0, "backward": 0, "reduce_grads": 0}
    pair = program.loss_last
    for part in calls:
        gm = getattr(pair, part)

        def counted(*args, _gm=gm, _part=part):
            calls[_part] += 1
            return _gm(*args)
        pair = dataclasses.replace(pair, **{part: counted})
    program.loss_last = pair
    pm.train_step(x, y)
    assert calls == {"forward": 4, "backward": 4, "reduce_grads": 1}


def test_micro_batches_must_divide_the_batch():
    with pytest.raises(ValueError, match=r"example_inputs 0 has dim 0 of size 10.*"
                                         r"num_micro_batches=4"):
        torchalpa.auto_parallel(MLP(16, 2), mlp_inputs(10, 16), F.mse_loss,
                                num_micro_batches=4, method=torchalpa.ShardParallel())
    with pytest.raises(ValueError, match="num_micro_batches must be an int >= 1"):
        torchalpa.auto_parallel(MLP(16, 2), mlp_inputs(8, 16), F.mse_loss,
                                num_micro_batches=0, method=torchalpa.ShardParallel())


# -- mixed precision ----------------------------------------------------------------------

def test_mixed_precision_computes_in_bf16_with_float32_state():
    model, ref = twin(lambda: MLP(32, 3))
    x, y = mlp_inputs(16, 32)
    policy = MixedPrecision(param_dtype=torch.bfloat16)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss, mixed_precision=policy,
                                 method=torchalpa.ShardParallel())
    loss = pm(x, y)
    loss.backward()
    ref_loss = F.mse_loss(ref(x), y)
    assert loss.dtype == torch.float32                      # output_dtype: the loss in fp32
    assert "torch.bfloat16" in pm.local_program()
    assert {p.dtype for p in pm.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in pm.parameters()} == {torch.float32}
    assert loss.item() != ref_loss.item()                   # bf16 did change the numbers
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-3)


@pytest.mark.parametrize("family", ["gpt", "llama", "bert", "vit", "resnet", "moe",
                                    "hf_gpt2", "hf_llama", "hf_bert"])
def test_every_zoo_family_trains_in_bf16(family):
    """bf16 compute on the CPU catches what would fail on a GPU's first step: a float32
    table meeting bfloat16 weights (the zoo LLaMA's rotary tables), batch norm given
    bfloat16 weights beside float32 running statistics (ResNet). Both failed before."""
    import torchalpa.models as zoo
    if family.startswith("hf_"):
        pytest.importorskip("transformers")
    workload = zoo.tiny(family, batch_size=4)
    torch.manual_seed(0)
    model = workload.build()
    batch = workload.example_inputs()
    with torch.no_grad():
        ref_loss = workload.loss_fn(model(*batch[:-1]), batch[-1])     # float32 eager
    policy = MixedPrecision(param_dtype=torch.bfloat16)
    pm = torchalpa.auto_parallel(model, batch, workload.loss_fn, mixed_precision=policy,
                                 method=torchalpa.ShardParallel())
    loss = pm(*batch)
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert loss.item() == pytest.approx(ref_loss.item(), rel=5e-2)
    assert {p.grad.dtype for p in pm.parameters()} == {torch.float32}


def test_cast_forward_keeps_the_model_names():
    model = MLP(16, 2)
    wrapped = CastForward(model, MixedPrecision())
    assert list(wrapped.state_dict()) == list(model.state_dict())
    assert wrapped(torch.randn(2, 16)).dtype == torch.float32


def test_mixed_precision_options_are_validated():
    with pytest.raises(ValueError, match="reduce_dtype must be torch.float32 or the param_dtype"):
        MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.bfloat16)
    assert MixedPrecision(reduce_dtype=torch.bfloat16).narrow_reduction == "bfloat16"
    with pytest.raises(TypeError, match="param_dtype must be a floating torch.dtype"):
        MixedPrecision(param_dtype=torch.int8)
    with pytest.raises(TypeError, match="torchalpa.MixedPrecision"):
        torchalpa.auto_parallel(MLP(16, 2), mlp_inputs(8, 16), F.mse_loss,
                                mixed_precision="bf16", method=torchalpa.ShardParallel())


# -- torch.compile ------------------------------------------------------------------------

# Dynamo traces the local programs with either backend (the torchalpa side under test);
# inductor's C++ code generation takes most of a minute on a 2-core machine, so make test
# runs aot_eager and make test-all the default (inductor).
@pytest.mark.parametrize("compile_option", [
    pytest.param({"backend": "aot_eager"}, id="aot_eager"),
    pytest.param(True, id="inductor", marks=pytest.mark.slow)])
def test_local_programs_run_under_torch_compile(compile_option):
    from torch._dynamo.utils import counters
    counters.clear()
    x, y = mlp_inputs(16, 32)
    runs = []
    for compile in (False, compile_option):
        model, _ = twin(lambda: MLP(32, 2))
        pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss, optimizer=adam,
                                     compile=compile, method=torchalpa.ShardParallel())
        runs.append([pm.train_step(x, y).item() for _ in range(2)])
    assert "compiled with torch.compile" in pm.local_program()
    assert counters["stats"]["unique_graphs"] >= 2     # forward, backward (reduce_grads is
    #                                                   the identity on one rank)
    assert runs[1] == pytest.approx(runs[0], rel=1e-5)


# -- meta-device models -------------------------------------------------------------------

class WithRawParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, x):
        return self.fc(x) * self.scale


def test_meta_model_is_materialized_and_initialized():
    with torch.device("meta"):
        model = MLP(16, 2)
    pm = torchalpa.auto_parallel(model, mlp_inputs(8, 16), F.mse_loss, optimizer=adam,
                                 method=torchalpa.ShardParallel())
    weight = pm.module.net[0].weight
    assert weight.to_local().device.type == "cpu"
    assert 0.05 < weight.to_local().std().item() < 0.3     # kaiming-uniform, fan_in 16
    losses = [pm.train_step(*mlp_inputs(8, 16)).item() for _ in range(3)]
    assert losses[-1] < losses[0]


def test_meta_parameter_without_reset_parameters_warns_and_init_weights_sets_it():
    with torch.device("meta"):
        model = WithRawParameter()
    with pytest.warns(MaterializeWarning, match=r"\bscale\b.*init_weights"):
        torchalpa.auto_parallel(model, mlp_inputs(8, 16), F.mse_loss,
                                method=torchalpa.ShardParallel())

    def init(module):
        module.fc.reset_parameters()
        nn.init.constant_(module.scale, 2.0)

    with torch.device("meta"):
        model = WithRawParameter()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MaterializeWarning)
        pm = torchalpa.auto_parallel(model, mlp_inputs(8, 16), F.mse_loss, init_weights=init,
                                     method=torchalpa.ShardParallel())
    assert torch.equal(pm.module.scale.full_tensor(), torch.full((16,), 2.0))


# -- forward-only programs ----------------------------------------------------------------

def test_predict_and_eval_loss_on_one_process():
    model, ref = twin(lambda: MLP(16, 2))
    x, y = mlp_inputs(8, 16)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss, method=torchalpa.ShardParallel())
    assert torch.allclose(pm.predict(x), ref(x), atol=1e-6)
    assert pm.predict(x[:3]).shape == (3, 16)              # planned for that shape on use
    pm.eval()
    assert pm(x[:5], y[:5]).item() == pytest.approx(F.mse_loss(ref(x[:5]), y[:5]).item())


def test_train_step_needs_the_captured_mode():
    pm = torchalpa.auto_parallel(MLP(16, 2), mlp_inputs(8, 16), F.mse_loss, optimizer=adam,
                                 method=torchalpa.ShardParallel())
    pm.eval()
    with pytest.raises(ValueError, match=r"captured in training mode.*pmodel.train\(\)"):
        pm.train_step(*mlp_inputs(8, 16))


def test_local_program_shows_the_three_programs():
    pm = torchalpa.auto_parallel(MLP(16, 2), mlp_inputs(8, 16), F.mse_loss,
                                 method=torchalpa.ShardParallel())
    text = pm.local_program()
    assert "# forward" in text and "# backward" in text and "# reduce_grads" in text


# -- checkpoints --------------------------------------------------------------------------

def test_checkpoint_round_trip_and_errors(tmp_path):
    x, y = mlp_inputs(8, 16)
    make = lambda: torchalpa.auto_parallel(MLP(16, 2), (x, y), F.mse_loss,  # noqa: E731
                                           optimizer=adam, method=torchalpa.ShardParallel())
    torch.manual_seed(0)
    pm = make()
    pm.train_step(x, y)
    save_checkpoint(tmp_path / "ck", pm)
    after = [pm.train_step(x, y).item() for _ in range(2)]
    torch.manual_seed(1)
    again = make()
    load_checkpoint(tmp_path / "ck", again)
    assert [again.train_step(x, y).item() for _ in range(2)] == after
    with pytest.raises(ValueError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "missing", again)
    with pytest.raises(TypeError, match="ParallelModule"):
        save_checkpoint(tmp_path / "x", MLP(16, 2))


# -- communication overlap ----------------------------------------------------------------

def test_overlap_waits_for_a_collective_where_its_result_is_first_used():
    from torchalpa.runtime.execution import collectives as C
    from torchalpa.runtime.rewrites.overlap import overlap_collectives
    graph = torch.fx.Graph()
    grad, act = graph.placeholder("grad"), graph.placeholder("act")
    reduced = graph.call_function(C.all_reduce, (grad, "sum", "g0"))
    gathered = graph.call_function(C.all_gather, (act, 1, 4, "g0"))
    more = graph.call_function(torch.relu, (act,))            # independent work
    used = graph.call_function(torch.add, (gathered, 1))
    graph.output((reduced, more, used))
    gm = overlap_collectives(torch.fx.GraphModule(torch.nn.Module(), graph))
    names = [n.target.__name__ if callable(n.target) else n.target for n in gm.graph.nodes
             if n.op == "call_function"]
    assert names == ["issue_all_reduce", "issue_all_gather", "relu", "finish_all_gather", "add",
                     "finish_all_reduce"]
    finish = next(n for n in gm.graph.nodes if n.name.startswith("finish_all_gather"))
    assert finish.args[1:] == (1, 4)                      # dim and group size for the re-layout


def test_parameter_gathers_are_issued_one_parameter_ahead():
    """ZeRO-3: the second parameter's all-gather starts once the first has been waited
    for, before the matmul that reads the first runs (and before the activation's gather
    that preceded it); the activation's gather itself stays put."""
    from torchalpa.runtime.execution import collectives as C
    from torchalpa.runtime.rewrites.overlap import overlap_collectives, prefetch_parameter_gathers
    graph = torch.fx.Graph()
    x, w1, w2 = (graph.placeholder(n) for n in ("x", "w1", "w2"))
    full1 = graph.call_function(C.all_gather, (w1, 0, 4, "g0"))
    h = graph.call_function(torch.matmul, (x, full1))
    act = graph.call_function(C.all_gather, (h, 1, 4, "g0"))     # an activation: not moved
    full2 = graph.call_function(C.all_gather, (w2, 0, 4, "g0"))
    graph.output(graph.call_function(torch.matmul, (act, full2)))
    gm = overlap_collectives(torch.fx.GraphModule(torch.nn.Module(), graph))
    assert prefetch_parameter_gathers(gm) == 1
    names = [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
    assert names == ["issue_all_gather", "finish_all_gather", "issue_all_gather", "matmul",
                     "issue_all_gather", "finish_all_gather", "finish_all_gather", "matmul"]
    issued = [n.args[0].name for n in gm.graph.nodes if n.op == "call_function"
              and n.target is C.issue_all_gather]
    assert issued == ["w1", "w2", "matmul"]
    assert prefetch_parameter_gathers(gm) == 0                    # already ahead


def test_cast_gathers_are_issued_one_parameter_ahead_with_their_cast():
    """Mixed precision: a parameter cast to bfloat16 and transposed, then gathered. The
    second one's cast, transpose and gather move to right after the first gather's wait,
    before the matmul that reads the first; a value forward computes (an activation's
    gather) and a random draw on a parameter are not moved."""
    from torchalpa.runtime.execution import collectives as C
    from torchalpa.runtime.rewrites.overlap import overlap_collectives, prefetch_parameter_gathers
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x, w1, w2, w3 = (graph.placeholder(n) for n in ("x", "w1", "w2", "w3"))

    def cast_gather(w):
        low = graph.call_function(aten._to_copy.default, (w,), {"dtype": torch.bfloat16})
        t = graph.call_function(aten.permute.default, (low, [1, 0]))
        return graph.call_function(C.all_gather, (t, 0, 4, "g0"))

    h = graph.call_function(aten.mm.default, (x, cast_gather(w1)))
    h = graph.call_function(aten.relu.default, (h,))
    h = graph.call_function(aten.mm.default, (h, cast_gather(w2)))
    noisy = graph.call_function(aten.bernoulli.p, (w3, 0.5))   # a random draw: stays
    full3 = graph.call_function(C.all_gather, (noisy, 0, 4, "g0"))
    graph.output(graph.call_function(aten.mm.default, (h, full3)))
    gm = overlap_collectives(torch.fx.GraphModule(torch.nn.Module(), graph))
    assert prefetch_parameter_gathers(gm) == 1
    names = [str(n.target).split(".")[-2] if isinstance(n.target, torch._ops.OpOverload)
             else n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
    assert names == ["_to_copy", "permute", "issue_all_gather", "finish_all_gather",
                     "_to_copy", "permute", "issue_all_gather", "mm", "relu",
                     "finish_all_gather", "mm", "bernoulli", "issue_all_gather",
                     "finish_all_gather", "mm"]
    assert prefetch_parameter_gathers(gm) == 0                    # already ahead


def test_autograd_path_saves_items_of_multi_output_ops():
    """Layer norm returns (out, mean, rstd): backward saves the items, not the tuple."""
    from torchalpa.models import GPT, GPTConfig, lm_loss
    config = GPTConfig.tiny(dropout=0.0)
    tokens = torch.randint(config.vocab_size, (2, config.max_seq_len + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    model, ref = twin(lambda: GPT(config))
    pm = torchalpa.auto_parallel(model, (x, y), lm_loss, method=torchalpa.ShardParallel())
    loss = pm(x, y)
    loss.backward()
    ref_loss = lm_loss(ref(x), y)
    ref_loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for p, q in zip(pm.parameters(), ref.parameters()):
        assert torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)


# -- one lowering -------------------------------------------------------------------------

def test_an_intra_op_plan_lowers_as_a_one_stage_pipeline():
    """``lower`` (intra-op) and ``lower_stage`` on the same plan as the only stage of a
    pipeline build the same programs: there is one lowering, not two."""
    from torchalpa.core.cluster import LogicalMesh
    from torchalpa.core.plan import PipelinePlan, StagePlan
    from torchalpa.frontends.torch_export import capture
    from torchalpa.passes.sharding.intra_op import plan_intra_op
    from torchalpa.runtime.execution.pipeline import lower_stage
    from torchalpa.runtime.lowering.lower import lower
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    x, y = torch.randn(512, 16), torch.randn(512, 4)      # batch-split: batch norm reduces
    captured = capture(model, (x, y), F.mse_loss)
    plan = plan_intra_op(captured.graph, LogicalMesh(shape=(2,)))
    assert plan.collectives                                # something to lower
    every_node = {n.name: 0 for n in captured.gm.graph.nodes if n.op != "output"}
    one_stage = PipelinePlan(mesh_shape=(1, 2), stages=(StagePlan(0, (0,), (1, 2), (0, 1), plan),),
                             transfers=(), node_stage=every_node, num_micro_batches=1,
                             schedule="1f1b")
    where = dict(coords=(1,), group_names=["g0"], device=torch.device("cpu"))
    whole = lower(captured.gm, plan, captured.param_names,
                  buffer_updates=captured.buffer_updates, **where)
    stage = lower_stage(captured.gm, one_stage, 0, param_names=captured.param_names,
                        buffer_names=captured.buffer_names,
                        buffer_updates=captured.buffer_updates, **where)
    assert captured.buffer_updates and list(stage.buffer_updates) == captured.buffer_updates
    assert stage.params == captured.param_names and stage.has_loss
    assert not (stage.forward_recvs or stage.backward_recvs or stage.forward_sends
                or stage.backward_sends)
    for a, b in ((whole.forward, stage.forward), (whole.backward, stage.backward),
                 (whole.reduce_grads, stage.reduce_grads)):
        assert a.code == b.code
    assert "issue_all_reduce" in whole.code()
