"""A micro-batch's step derived from the whole batch's capture (frontends/rebatch.py) is
the step traced at the micro-batch: the same nodes, shapes, costs, module paths and
generated code; what could hold the batch as a number is traced again instead, and
AutoParallel's search traces the model once and plans as if it had traced each count."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
import torchalpa.models as zoo
from torchalpa.frontends import rebatch
from torchalpa.frontends.torch_export import capture
from torchalpa.parallel import auto


@pytest.mark.parametrize("family,ks", [("llama", (2, 6)), ("gpt", (3,))])
def test_the_derived_step_is_the_traced_one(family, ks):
    # batch 6: no size of these tiny models is a multiple of it (nothing refused by chance)
    workload = zoo.tiny(family, batch_size=6)
    with torch.device("meta"):
        model = workload.build()
    batch = workload.example_inputs(device="meta")
    whole = capture(model, batch, workload.loss_fn)
    for k in ks:
        traced = capture(model, tuple(x[: x.shape[0] // k] for x in batch), workload.loss_fn)
        derived = rebatch.rebatched_capture(whole, k)
        assert derived is not None
        assert list(derived.graph) == list(traced.graph)      # names, shapes, flops, modules
        assert derived.graph.meta == traced.graph.meta         # repeated blocks among them
        assert derived.gm.code == traced.gm.code               # view sizes in the code too
        assert derived.graph.spec(derived.graph.outputs.loss).shape == ()
    assert rebatch.rebatched_capture(whole, 1) is whole


class _Token(nn.Module):
    """A learned token broadcast to every example (ViT's class token)."""

    def __init__(self):
        super().__init__()
        self.token = nn.Parameter(torch.empty(1, 8))
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x + self.token.expand(x.shape[0], 8))


class _Zeros(nn.Module):
    """A constant of the batch's size, made from Python numbers."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x) + torch.zeros(x.shape[0], 8, device=x.device)


@pytest.mark.parametrize("module", [_Token, _Zeros])
def test_what_may_hold_the_batch_as_a_number_is_traced_again(module):
    with torch.device("meta"):
        model = module()
        batch = (torch.empty(6, 8), torch.empty(6, 8))
    whole = capture(model, batch, F.mse_loss)
    assert rebatch.rebatched_capture(whole, 2) is None


def test_the_search_traces_once_and_plans_as_if_it_traced_each_count(monkeypatch):
    workload = zoo.tiny("gpt", batch_size=6, dropout=0.0, num_layers=2)
    with torch.device("meta"):
        model = workload.build()
    batch, loss_fn = workload.example_inputs(device="meta"), workload.loss_fn
    cluster = torchalpa.Cluster.h100(1, 2)
    method = torchalpa.AutoParallel(remat=("none",), pipeline=False,
                                    rematerialize_parameters=False)
    meshes = auto.AutoResolver().target(method, cluster=cluster, mesh=None, world=1,
                                        live=False).meshes
    traces = []
    real = auto.capture_step
    monkeypatch.setattr(auto, "capture_step", lambda *a, **k: traces.append(1) or real(*a, **k))

    def plans():
        session = auto.SearchSession(model, batch, loss_fn, method=method, cluster=cluster,
                                     meshes=meshes, allow_pipeline=False)
        return [session.solve(auto.Candidate("intra-op", "none", k, 0.0, 0.0)).to_json()
                for k in (1, 3)]

    derived = plans()
    assert len(traces) == 1
    monkeypatch.setattr(rebatch, "rebatched_capture", lambda captured, k: None)
    traced = plans()
    assert len(traces) == 3                 # without the derivation: one trace per count
    assert derived == traced
