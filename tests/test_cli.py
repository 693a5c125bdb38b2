"""torchalpa's command line: ``torchalpa coverage``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models import MLP, WithCustomOp
from torchalpa.cli import main


def mlp_step():
    """A ``module:callable`` model: (model, example_inputs, loss_fn), built on meta."""
    x, y = torch.empty(4, 8), torch.empty(4, 8)
    return MLP(8, 2), (x, y), F.mse_loss


def custom_op_step():
    x, y = torch.empty(4, 8), torch.empty(4, 8)
    return WithCustomOp(8), (x, y), F.mse_loss


def test_coverage_lists_the_ops_of_a_training_step(capsys):
    assert main(["coverage", "--model", "test_cli:mlp_step"]) == 0
    out = capsys.readouterr().out
    assert "rule  aten.mm.default" in out
    assert "rule  aten.relu.default" in out
    assert "ops without a sharding rule (run replicated): none" in out


def test_coverage_names_ops_without_a_rule(capsys):
    assert main(["coverage", "--model", "test_cli:custom_op_step"]) == 1
    out = capsys.readouterr().out
    assert "----  torchalpa_test.scaled_tanh.default" in out
    assert "torchalpa_test.scaled_tanh.default: test_cli:custom_op_step" in out


def test_coverage_of_a_zoo_model(capsys):
    pytest.importorskip("torchalpa.models")
    assert main(["coverage", "--model", "llama"]) == 0
    assert "rule  torchalpa.sdpa.default" in capsys.readouterr().out


def test_coverage_reports_models_it_cannot_load(capsys):
    assert main(["coverage", "--model", "no_such_module:step"]) == 1
    assert "no_such_module:step: could not capture" in capsys.readouterr().out


def test_a_command_is_required():
    with pytest.raises(SystemExit):
        main([])
