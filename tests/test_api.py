"""auto_parallel without torchrun (a world of one process) and its error messages."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from models import MLP, mlp_inputs

import torchalpa


def test_one_process_trains_like_eager(single_process_world):
    torch.manual_seed(0)
    model = MLP(32, 3)
    torch.manual_seed(0)
    ref = MLP(32, 3)
    x, y = mlp_inputs(16, 32)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss,
                                 optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                 method=torchalpa.ShardParallel())
    assert pm.plan.mesh_shape == (1,) and pm.plan.collectives == ()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for _ in range(3):
        loss = pm.train_step(x, y)
        ref_loss = F.mse_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    for p, q in zip(pm.parameters(), ref.parameters()):
        assert torch.allclose(p.full_tensor(), q, atol=1e-6)
    assert "aten.mm" in pm.local_program()


def test_eval_and_no_grad_run_forward_only(single_process_world):
    pm = torchalpa.auto_parallel(MLP(16, 2), mlp_inputs(8, 16), F.mse_loss,
                                 method=torchalpa.ShardParallel())
    with torch.no_grad():
        loss = pm(*mlp_inputs(8, 16))
    assert loss.requires_grad is False and loss.numel() == 1


def test_world_size_must_match_the_mesh(single_process_world):
    method = torchalpa.ShardParallel(logical_mesh_shape=(4,))
    with pytest.raises(ValueError, match=r"needs 4 ranks but this job has 1.*nproc_per_node=4"):
        torchalpa.auto_parallel(MLP(16, 2), mlp_inputs(8, 16), F.mse_loss, method=method)


def test_train_step_without_optimizer_says_how(single_process_world):
    pm = torchalpa.auto_parallel(MLP(16, 2), mlp_inputs(8, 16), F.mse_loss,
                                 method=torchalpa.ShardParallel())
    with pytest.raises(ValueError, match="optimizer="):
        pm.train_step(*mlp_inputs(8, 16))


def test_a_saved_plan_is_reused_and_checked(single_process_world, tmp_path):
    x, y = mlp_inputs(8, 16)
    plan = torchalpa.auto_parallel(MLP(16, 2), (x, y), F.mse_loss,
                                   method=torchalpa.ShardParallel()).plan
    plan.save(tmp_path / "plan.json")
    again = torchalpa.auto_parallel(MLP(16, 2), (x, y), F.mse_loss,
                                    plan=torchalpa.Plan.load(tmp_path / "plan.json"),
                                    method=torchalpa.ShardParallel())
    assert again.plan == plan
    with pytest.raises(ValueError, match="different training step"):
        torchalpa.auto_parallel(MLP(16, 3), (x, y), F.mse_loss, plan=plan,
                                method=torchalpa.ShardParallel())


def test_bad_arguments(single_process_world):
    with pytest.raises(ValueError, match="inputs must be"):
        torchalpa.auto_parallel(MLP(16, 2), mlp_inputs(8, 16), F.mse_loss, inputs="sharded",
                                method=torchalpa.ShardParallel())
    with pytest.raises(TypeError, match="method"):
        torchalpa.auto_parallel(MLP(16, 2), mlp_inputs(8, 16), F.mse_loss, method="dp")
    with pytest.raises(TypeError, match="example_inputs"):
        torchalpa.auto_parallel(MLP(16, 2), ([1, 2], torch.zeros(2)), F.mse_loss,
                                method=torchalpa.ShardParallel())


def test_pipeline_options_that_cannot_be_honoured_say_why(single_process_world):
    """Under PipeshardParallel, auto_parallel's options either mean what they mean for
    ShardParallel or raise before any process group is made, naming the fix."""
    method = torchalpa.PipeshardParallel(num_micro_batches=2)
    x, y = mlp_inputs(8, 16)

    def wrap(**options):
        torchalpa.auto_parallel(MLP(16, 2), (x, y), F.mse_loss, method=method, **options)
    with pytest.raises(ValueError, match=r"num_micro_batches=4 disagrees .*num_micro_batches=2"):
        wrap(num_micro_batches=4)
    with pytest.raises(ValueError, match="num_micro_batches must be an int >= 1"):
        wrap(num_micro_batches=0)
    with pytest.raises(ValueError, match="one DeviceMesh per stage .* cluster="):
        wrap(mesh=object())
    with pytest.raises(ValueError, match="needs inputs='global'"):
        wrap(inputs="local")
    with pytest.raises(ValueError, match="needs inputs='global'"):
        torchalpa.plan(MLP(16, 2), (x, y), F.mse_loss, method=method, inputs="local")
    with pytest.raises(ValueError, match="init_weights= is not supported"):
        wrap(init_weights=lambda m: None)
    assert not dist.is_initialized()


def test_pipeline_num_micro_batches_set_once():
    from torchalpa.parallel.pipeshard import pipeline_options
    default = torchalpa.PipeshardParallel()
    assert pipeline_options(default, num_micro_batches=4).num_micro_batches == 4
    assert pipeline_options(default).num_micro_batches == 1
    four = torchalpa.PipeshardParallel(num_micro_batches=4)
    assert pipeline_options(four, num_micro_batches=4) == four
    assert pipeline_options(four) == four


def test_entry_points_dispatch_through_the_method_table(single_process_world, monkeypatch):
    """plan / auto_parallel check the common arguments, then take the one orchestration
    with the steps the table gives the method's class: a method registered there is
    planned and built through its own steps, with every option handed on."""
    from torchalpa.parallel import methods
    from torchalpa.parallel.shard import IntraOpSteps

    calls: dict[str, dict] = {}

    class Recording(torchalpa.ShardParallel):
        pass

    class RecordingSteps(IntraOpSteps):
        def with_options(self, method, **options):
            calls.setdefault("with_options", {}).update(options)
            return super().with_options(method, **options)

        def solve(self, graph, target, method, inputs, measured=None):
            calls["solve"] = {"method": type(method).__name__, "inputs": inputs}
            return super().solve(graph, target, method, inputs, measured)

        def place(self, captured, plan, target, method, device, **options):
            calls["place"] = options
            return super().place(captured, plan, target, method, device, **options)

    monkeypatch.setitem(methods.STEPS, Recording, RecordingSteps())
    x, y = mlp_inputs(8, 16)
    plan = torchalpa.plan(MLP(16, 2), (x, y), F.mse_loss, method=Recording())
    assert plan.method["name"] == "Recording" and calls["solve"]["method"] == "Recording"
    assert "place" not in calls             # planning places nothing
    torchalpa.auto_parallel(MLP(16, 2), (x, y), F.mse_loss, method=Recording())
    assert sorted(calls["with_options"]) == sorted(
        ["inputs", "signature", "mesh", "num_micro_batches", "init_weights"])
    assert sorted(calls["place"]) == ["inputs", "loss_fn", "model", "signature", "traced"]
    with pytest.raises(TypeError, match="method must be a torchalpa method"):
        torchalpa.plan(MLP(16, 2), (x, y), F.mse_loss, method=object())


def test_each_kind_of_work_has_its_own_narrow_protocol_and_no_implementation_only_refuses():
    """A method is in the table of each kind of work it does (training steps, resolving,
    generation, programs), implementing every member of that protocol with a body that
    does the work; asking a method for work it does not do is one ValueError naming the
    method to use, from the lookup."""
    import ast
    import inspect
    import re
    import textwrap

    from torchalpa.parallel import methods, steps

    tables = {steps.MethodSteps: methods.STEPS, steps.MethodResolver: methods.RESOLVERS,
              steps.GenerationSteps: methods.GENERATION, steps.ProgramSteps: methods.PROGRAMS}
    for protocol, table in tables.items():
        members = [n for n, v in vars(protocol).items()
                   if callable(v) and not n.startswith("_")]
        for impl in table.values():
            for name in members:
                fn = getattr(type(impl), name)
                body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
                body = [s for s in body if not (isinstance(s, ast.Expr)
                                                and isinstance(s.value, ast.Constant))]
                assert not all(isinstance(s, ast.Raise) for s in body), \
                    f"{type(impl).__name__}.{name} only refuses"
    assert not re.search(r"\bAny\b", inspect.getsource(steps))     # typed, every member
    x, y = mlp_inputs(8, 16)
    with pytest.raises(ValueError, match="pipelined generation is not built"):
        torchalpa.plan(MLP(16, 2), (x,), method=torchalpa.PipeshardParallel(),
                       mode="inference")


def test_auto_parallel_captures_the_step_once(single_process_world, monkeypatch):
    """The default method's search captures the step; building the module reuses that
    capture instead of tracing the model again."""
    from torchalpa.frontends import torch_export
    traced = []
    capture = torch_export.capture

    def counting(*args, **kwargs):
        traced.append(1)
        return capture(*args, **kwargs)

    monkeypatch.setattr(torch_export, "capture", counting)
    monkeypatch.setenv("TORCHALPA_CACHE", "0")
    torch.manual_seed(0)
    model = MLP(32, 3)
    torch.manual_seed(0)
    ref = MLP(32, 3)
    x, y = mlp_inputs(16, 32)
    pm = torchalpa.auto_parallel(model, (x, y), F.mse_loss,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=1e-2))
    assert len(traced) == 1
    loss = pm.train_step(x, y)
    assert loss.item() == pytest.approx(F.mse_loss(ref(x), y).item(), rel=1e-6)
