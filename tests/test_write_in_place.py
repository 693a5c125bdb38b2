"""A write into a buffer nothing reads afterwards: run in place by the runtime
(``runtime/rewrites/write_in_place.py``) and priced as that buffer by the memory model
(``passes/pricing/buffer_reuse.py``), by the same rule."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from torchalpa.core.inplace_forms import IN_PLACE_FORMS
from torchalpa.frontends.torch_export import capture
from torchalpa.passes.pricing.memory import liveness
from torchalpa.runtime.rewrites.write_in_place import write_in_place

aten = torch.ops.aten


def _program(read_after: bool = False, viewed: bool = False, from_input: bool = False):
    """``scatter(zeros, idx, 1.0)`` in an fx program; the zeros read again after the
    scatter, or viewed before it, or the program's input instead of its own result."""
    g = fx.Graph()
    x, idx = g.placeholder("x"), g.placeholder("idx")
    base = x if from_input else g.call_function(aten.zeros_like.default, (x,))
    view = g.call_function(aten.t.default, (base,)) if viewed else None
    out = g.call_function(aten.scatter.value, (base, 1, idx, 1.0))
    result = [out]
    if read_after:
        result.append(g.call_function(aten.add.Tensor, (base, 1.0)))
    if view is not None:
        result.append(view)
    g.output(tuple(result))
    return fx.GraphModule(nn.Module(), g)


def _aten(name: str):
    """``torch.ops.aten.<op>.<overload>`` of ``aten.<op>.<overload>``."""
    _, op, overload = name.split(".")
    return getattr(getattr(aten, op), overload)


def _targets(program: fx.GraphModule) -> list:
    return [n.target for n in program.graph.nodes if n.op == "call_function"]


def test_the_runtime_writes_into_a_buffer_only_it_reads():
    x, idx = torch.randn(4, 6), torch.tensor([[1], [3], [0], [5]])
    expected = torch.zeros(4, 6).scatter(1, idx, 1.0)
    program = _program()
    assert write_in_place(program) == 1
    assert aten.scatter_.value in _targets(program)
    assert torch.equal(program(x, idx)[0], expected)
    for kept in (_program(read_after=True), _program(viewed=True), _program(from_input=True)):
        assert write_in_place(kept) == 0
        assert aten.scatter_.value not in _targets(kept)
    before = x.clone()
    _program(from_input=True)(x, idx)
    assert torch.equal(x, before)               # the caller's tensor is never written


def test_a_collective_s_buffer_is_never_written():
    """A wait's result is the collective's buffer (its schema does not say so): a scatter
    into it stays out of place."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the ops)
    g = fx.Graph()
    x, idx = g.placeholder("x"), g.placeholder("idx")
    zeros = g.call_function(aten.zeros_like.default, (x,))
    waited = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (zeros,))
    g.output((g.call_function(aten.scatter.value, (waited, 1, idx, 1.0)),))
    program = fx.GraphModule(nn.Module(), g)
    assert write_in_place(program) == 0


def test_every_form_has_its_in_place_op_with_the_same_values():
    """Each op of the table: its in-place op gives the out-of-place result, bit for bit."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4, 6, generator=g)
    idx = torch.tensor([[1], [3], [0], [5]])
    rows = torch.tensor([2, 0])
    src = torch.randn(4, 6, generator=g)
    args = {"aten.scatter.value": (1, idx, 2.0), "aten.scatter.src": (1, idx, src),
            "aten.scatter_add.default": (1, idx, src), "aten.scatter_reduce.two": (1, idx, src, "sum"),
            "aten.index_put.default": ((rows,), src[:2], True),
            "aten.index_add.default": (0, rows, src[:2]), "aten.index_copy.default": (0, rows, src[:2])}
    assert set(args) == set(IN_PLACE_FORMS)
    for functional, in_place in IN_PLACE_FORMS.items():
        out_of_place = _aten(functional)(base, *args[functional])
        written = base.clone()
        _aten(in_place)(written, *args[functional])
        assert torch.equal(written, out_of_place), functional


class _Scatters(nn.Module):
    def __init__(self, keep_zeros: bool):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.keep_zeros = keep_zeros

    def forward(self, x):
        h = self.lin(x)
        zeros = torch.zeros_like(h)
        mask = zeros.scatter(-1, h.topk(2, dim=-1).indices, 1.0)
        return h * mask + (zeros if self.keep_zeros else 0.0)


def test_the_memory_model_shares_the_buffer_by_the_runtime_rule():
    x = torch.randn(32, 64)
    for keep_zeros in (False, True):
        graph = capture(_Scatters(keep_zeros), (x, torch.randn(32, 64)), F.mse_loss).graph
        scatter = next(n.name for n in graph if n.op == "aten.scatter.value")
        zeros = next(n.name for n in graph if n.op in ("aten.full_like.default",
                                                       "aten.zeros_like.default")
                     and n.outputs[0].shape == (32, 64))
        live = liveness(graph)
        # shared: no entry of its own, and the zeros' interval runs to the scatter's readers
        assert (scatter in live.names) == keep_zeros
        end = max(e for name, e in zip(live.names, live.end) if name == zeros)
        readers = [i for i, n in enumerate(graph) if any(r.node == scatter for r in n.operands)]
        assert (end >= max(readers)) == (not keep_zeros)


def test_zeros_written_in_place_stay_fresh_each_call_after_constant_folding():
    """The program's zeros read no input, so ``fold_constants`` would compute them once and
    keep them as a buffer; written in place, that buffer would carry the last call's
    scatter into the next (a loss's backward on its second micro-batch). They stay
    computed each call."""
    from torchalpa.runtime.rewrites.call_overhead import cut_call_overhead
    g = fx.Graph()
    idx = g.placeholder("idx")
    zeros = g.call_function(aten.full.default, ([4, 6], 0.0), {"dtype": torch.float32})
    g.output((g.call_function(aten.scatter.value, (zeros, 1, idx, -1.0)),))
    program = fx.GraphModule(nn.Module(), g)
    assert write_in_place(program) == 1
    fast = cut_call_overhead(program)
    first, second = torch.tensor([[1], [3], [0], [5]]), torch.tensor([[0], [0], [2], [2]])
    fast(first)
    assert torch.equal(fast(second)[0], torch.zeros(4, 6).scatter(1, second, -1.0))
