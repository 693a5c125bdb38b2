"""Out of torchalpa: unwrap(), save_pretrained, and last_step_stats (one process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from models import MLP, mlp_inputs
from torch.distributed.tensor import DTensor

import torchalpa

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("single_process_world")   # conftest.py


def tiny_gpt2():
    from torchalpa.models.hf import hf_config, hf_loss_fn
    config = hf_config("gpt2")
    assert config.tie_word_embeddings
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(config.vocab_size, (2, 8))
    return model, ids, hf_loss_fn("gpt2")


@pytest.mark.slow
def test_unwrap_and_save_pretrained_give_the_trained_model(tmp_path):
    model, ids, loss_fn = tiny_gpt2()
    pm = torchalpa.auto_parallel(model, (ids, ids.clone()), loss_fn,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                 method=torchalpa.ShardParallel())
    pm.train_step(ids, ids.clone())                   # the weights change
    plain = pm.unwrap()
    assert not any(isinstance(p, DTensor) for p in plain.parameters())
    assert plain.lm_head.weight is plain.transformer.wte.weight          # still tied
    trained = {k: v.full_tensor() for k, v in pm.module.state_dict().items()
               if isinstance(v, DTensor)}
    for name, p in plain.named_parameters():
        assert torch.equal(p, trained[name]), name
    plain.eval()
    out = plain.generate(ids[:1, :4], max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)

    torchalpa.save_pretrained(pm, tmp_path / "out")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys   # once
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, plain(ids).logits, atol=1e-6)


def test_last_step_stats_next_to_the_estimates():
    x, y = mlp_inputs(8, 16)
    pm = torchalpa.auto_parallel(MLP(16, 2), (x, y), F.mse_loss, method=torchalpa.ShardParallel())
    with pytest.raises(ValueError, match="no step has completed"):
        pm.last_step_stats()
    pm(x, y).backward()
    stats = pm.last_step_stats()
    assert stats.step_time_s > 0 and stats.includes == "forward+backward"
    assert stats.tokens == 8 and stats.tokens_per_s == pytest.approx(8 / stats.step_time_s)
    assert stats.estimated_step_time_s == pm.plan.estimates["step_time_s"]
    from torchalpa.runtime.measurement.issued import issued_collectives
    assert stats.planned_collectives == len(issued_collectives(pm.plan))
    assert "tokens/s" in str(stats) and "(plan: " in str(stats)
