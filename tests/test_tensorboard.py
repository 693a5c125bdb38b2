"""``torchalpa.TensorBoardHook``: last_step_stats per step, read back from the event file."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from models import MLP, mlp_inputs

import torchalpa
from torchalpa.runtime.measurement.stats import StepStats

pytestmark = pytest.mark.usefixtures("single_process_world")   # conftest.py


def read_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the event files under ``log_dir``, as TensorBoard itself reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_each_step_is_written_with_the_stats_it_measured(tmp_path):
    x, y = mlp_inputs(8, 16)
    pm = torchalpa.auto_parallel(MLP(16, 2), (x, y), F.mse_loss,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                 method=torchalpa.ShardParallel())
    written: list[StepStats] = []
    losses = []
    with torchalpa.TensorBoardHook(tmp_path / "run") as hook:
        for step in range(3):
            loss = pm.train_step(x, y)
            losses.append(float(loss))
            written.append(hook(pm, step, loss=loss))
    scalars = read_scalars(tmp_path / "run")
    assert [s for s, _ in scalars["torchalpa/step_time_s"]] == [0, 1, 2]
    for tag, field in [("step_time_s", "step_time_s"), ("tokens_per_s", "tokens_per_s"),
                       ("planned_bytes_sent", "planned_bytes_sent"),
                       ("bytes_sent", "measured_bytes_sent"),
                       ("plan/step_time_s", "estimated_step_time_s"), ("mfu", "mfu")]:
        got = [v for _, v in scalars[f"torchalpa/{tag}"]]
        assert got == pytest.approx([getattr(s, field) for s in written], rel=1e-6), tag
    assert [v for _, v in scalars["torchalpa/loss"]] == pytest.approx(losses, rel=1e-6)
    assert losses[-1] < losses[0]
    # the plan's flops and peak make an MFU; it is what the stats say it is
    est = pm.plan.estimates
    assert written[-1].mfu == pytest.approx(
        est["flops_per_step"] / pm.plan.num_devices / written[-1].step_time_s
        / est["peak_flops_per_device"])


def test_without_tensorboard_the_error_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="pip install tensorboard"):
        torchalpa.TensorBoardHook(tmp_path)


def test_log_dir_and_writer_are_exclusive(tmp_path):
    with pytest.raises(ValueError, match="not both"):
        torchalpa.TensorBoardHook(tmp_path, writer=object())
