"""What planning keeps to go faster must not change what it answers: the graph's
fingerprint memo, the collector paused while planning."""

from __future__ import annotations

import copy
import gc
import pickle
from dataclasses import replace

import torch
import torch.nn as nn

from torchalpa.frontends.torch_export import capture
from torchalpa.parallel.workflow import GC_YOUNG_THRESHOLD, planning_gc


def _graph():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    return capture(model, (torch.randn(4, 8),), lambda out: out.sum()).graph


def test_fingerprint_memo_follows_outputs_and_survives_pickling():
    graph = _graph()
    first = graph.fingerprint()
    assert graph.fingerprint() == first
    # pickled and copied graphs drop the memo (a hash object) and hash to the same
    assert pickle.loads(pickle.dumps(graph)).fingerprint() == first
    assert copy.deepcopy(graph).fingerprint() == first
    assert capture_again_fingerprint() == first
    # outputs and meta are read on every call: changing them changes the fingerprint
    graph.outputs = replace(graph.outputs, grads=graph.outputs.grads[:-1])
    assert graph.fingerprint() != first
    graph.meta["batch_split"] = ["x"]
    assert len({first, graph.fingerprint()}) == 2


def capture_again_fingerprint() -> str:
    return _graph().fingerprint()


def test_planning_gc_restores_the_collector():
    before = gc.get_threshold()
    assert gc.isenabled()
    with planning_gc():
        assert gc.get_threshold()[0] == max(before[0], GC_YOUNG_THRESHOLD)
        assert gc.get_freeze_count() > 0
        with planning_gc():          # nested: the outermost call owns the collector
            assert gc.get_threshold()[0] == max(before[0], GC_YOUNG_THRESHOLD)
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
