"""The cycle collector held off while a step is traced, and why that changes nothing."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn as nn

import torchalpa.frontends.torch_export as te
import torchalpa.models as zoo
from torchalpa.frontends.collector import collector_paused


@pytest.fixture
def collector_on():
    """Every test starts with the collector enabled and leaves it as it found it."""
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_the_collector_is_off_inside_and_back_after(collector_on):
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), collector_paused():
        raise ValueError("the trace failed")
    assert gc.isenabled()


def test_a_collector_the_caller_disabled_stays_disabled(collector_on):
    gc.disable()
    with collector_paused():
        pass
    assert not gc.isenabled()


class _Probe(nn.Module):
    """Records whether the collector runs while its forward is traced."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.seen: list[bool] = []

    def forward(self, x):
        self.seen.append(gc.isenabled())
        return self.linear(x).sum()


def test_capture_traces_with_the_collector_off_and_turns_it_on_after(collector_on):
    model = _Probe()
    te.capture(model, (torch.randn(2, 4),))
    assert model.seen == [False]
    assert gc.isenabled()


@pytest.mark.parametrize("family", ["llama", "bert", "resnet"])
def test_a_trace_leaves_no_cycles_for_the_collector(family, collector_on, monkeypatch):
    """The premise of pausing it: nothing a trace made is left for the collector, so it
    frees nothing that would otherwise have been freed during the trace."""
    found: list[int] = []
    trace = te._trace

    def trace_then_collect(*args, **kwargs):
        gc.collect()                       # what came before the trace is not its garbage
        gm = trace(*args, **kwargs)
        found.append(gc.collect())
        return gm

    monkeypatch.setattr(te, "_trace", trace_then_collect)
    workload = zoo.tiny(family, batch_size=2)
    te.capture(workload.build(), workload.example_inputs(), workload.loss_fn)
    assert found == [0]
