"""``plan.summary()`` names the module and the model's line of each op it lists: the
collectives (the op each one serves) and ops without a rule, from the torch capture's
provenance (``frontends/provenance.py``); a StableHLO program's locations:
``tests/test_export_locations.py``."""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

import torchalpa
from torchalpa.core.cluster import Cluster
from torchalpa.core.plan import Plan


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 256)
        self.down = torch.nn.Linear(256, 64)

    def forward(self, x):
        hidden = torch.relu(self.up(x))
        return self.down(hidden)


FORWARD_LINE = inspect.getsourcelines(Net.forward)[1]
LINES = {f"tests/test_summary_locations.py:{FORWARD_LINE + k}" for k in (1, 2)}


def _plan():
    torch.manual_seed(0)
    mesh = Cluster.local_cpu(2).logical_mesh((2,))
    return torchalpa.plan(Net(), (torch.randn(32, 64), torch.randn(32, 64)), F.mse_loss,
                          cluster=mesh, method=torchalpa.ShardParallel())


def test_collectives_carry_the_line_of_the_op_they_serve():
    plan = _plan()
    assert plan.collectives
    for c in plan.collectives:
        if c.source in ("up", "down"):
            assert c.stack in LINES, (c.source, c.stack)
    assert any(c.stack for c in plan.collectives)
    full = plan.summary(detail="full")
    assert any(line in full for line in LINES), full
    assert any(line in plan.summary() for line in LINES), plan.summary()
    again = Plan.from_dict(plan.to_dict())
    assert [c.stack for c in again.collectives] == [c.stack for c in plan.collectives]



class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(4, 4)

    def forward(self, x):
        q = self.qkv(x)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)


def test_attention_is_named_by_the_models_line_not_torchalpas_wrapper():
    from torchalpa.parallel.workflow import capture_step
    line = f"tests/test_summary_locations.py:{inspect.getsourcelines(Attention.forward)[1] + 2}"
    graph = capture_step(Attention(), (torch.randn(2, 2, 8, 4), torch.randn(2, 2, 8, 4)),
                         F.mse_loss).graph
    attention = [n for n in graph.ops() if n.op.startswith("torchalpa.sdpa")]
    assert len(attention) == 2 and {n.stack for n in attention} == {line}, \
        [(n.op, n.stack) for n in attention]
