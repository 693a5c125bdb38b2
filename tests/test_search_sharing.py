"""What AutoParallel's candidates carry from one to the next without changing a plan:
values found read twice alike on a view (``plan_intra_op(sharing=)``), so a later
candidate's ILP needs no sharing round to find them again; and the derived captures' code
made only when read or run (``block_remat.lazy_graph_module``)."""

import pytest
import torch

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.options import AutoShardingOption, ShardParallel
from torchalpa.frontends.block_remat import checkpointed_capture
from torchalpa.parallel.shard import blocks_of
from torchalpa.parallel.workflow import capture_examples, capture_step, with_precision
from torchalpa.passes.sharding import intra_op


@pytest.fixture(scope="module")
def llama():
    """LLaMA-3-8B's layer at 2 layers, bf16, batch 2 x 512 (shapes only)."""
    w = zoo.llama3_8b(batch_size=2, seq_len=512).replace(num_layers=2)
    with torch.device("meta"):
        model = w.build()
    model = with_precision(model, torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    batch = w.example_inputs(device="meta")
    return capture_step(model, capture_examples(model, batch, 1), w.loss_fn)


def _solves(monkeypatch) -> list:
    calls = []
    real = intra_op._solve_within_memory
    monkeypatch.setattr(intra_op, "_solve_within_memory",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_a_view_starts_from_the_values_found_read_twice_alike_before(llama, monkeypatch):
    graph = llama.graph
    mesh = torchalpa.Cluster.h100(1, 8).logical_mesh((2, 4))
    method = ShardParallel(auto_sharding_option=AutoShardingOption(
        exact_below=0, free_followers_below=0))
    calls = _solves(monkeypatch)
    sharing: dict = {}
    first = intra_op.plan_intra_op(graph, mesh, method, blocks=blocks_of(graph),
                                   sharing=sharing)
    rounds = len(calls)
    key = intra_op.sharing_key(mesh)
    assert rounds >= 2 and sharing[key]       # a round found values read twice alike
    calls.clear()
    again = intra_op.plan_intra_op(graph, mesh, method, blocks=blocks_of(graph),
                                   sharing=sharing)
    assert len(calls) == 1                    # none found again: one solve
    assert again.estimates.step_time_s == pytest.approx(first.estimates.step_time_s,
                                                        rel=1e-9)
    calls.clear()
    alone = intra_op.plan_intra_op(graph, mesh, method, blocks=blocks_of(graph))
    assert len(calls) == rounds and alone.estimates.step_time_s == \
        first.estimates.step_time_s          # without ``sharing``: as before


class _Twice(torch.nn.Module):
    """One weight read twice in forward."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return torch.relu(x @ self.w) @ self.w


def test_a_regathering_solve_takes_no_parameter_from_the_values_found():
    """With parameters gathered again in backward their reads share no copy
    (``shared_reshard.read_key``): a parameter found read twice alike by a solve that
    keeps them is not priced once per layout there; values the graph does not read twice
    (another variant's) are dropped."""
    model = _Twice()
    graph = capture_step(model, (torch.randn(4, 8), torch.randn(4, 8)),
                         torch.nn.functional.mse_loss).graph
    every = sorted(intra_op.multi_read_values(graph))
    param = next(v for v in every if graph.node(v[0]).kind == "param")
    activation = next(v for v in every if graph.node(v[0]).kind not in ("param", "buffer"))
    gone = ("no such node", 0)
    found = frozenset({param, activation, gone})
    keep = intra_op._sharing_seed(graph, found, AutoShardingOption())
    regather = intra_op._sharing_seed(graph, found, AutoShardingOption(
        rematerialize_parameters=True))
    assert keep == {param, activation} and regather == {activation}


def test_derived_captures_make_their_code_when_read(llama):
    derived = checkpointed_capture(llama, "full")
    lazy = type(derived.gm).__mro__
    assert any(c.__name__ == "_LazyGraphModule" for c in lazy)
    assert "def forward" in derived.gm.code         # made when read
    assert derived.graph.meta["remat"]["blocks"] == 2
