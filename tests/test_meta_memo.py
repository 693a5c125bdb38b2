"""Meta-kernel results remembered by their arguments' layouts (frontends/meta_memo.py): a
remembered call answers with a fresh tensor laid out as the op's own result; numbers keep
their type in the key; views, writes and tensors off ``meta`` always run; and a micro-batch
step derived, or a step recorded, with the memo is the one made without it."""

from __future__ import annotations

import torch

import torchalpa.models as zoo
from torchalpa.frontends import meta_memo, rebatch
from torchalpa.frontends.torch_export import capture, record_step

aten = torch.ops.aten


def _layout(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.stride(), t.storage_offset(), t.dtype,
            t.untyped_storage().nbytes(), t.device)


def test_an_identical_call_is_answered_with_a_fresh_tensor_laid_out_as_the_ops_result():
    memo = meta_memo.MetaMemo()
    a = torch.empty(4, 6, dtype=torch.bfloat16, device="meta")
    b = torch.empty(6, dtype=torch.float32, device="meta")
    first = memo(aten.add.Tensor, (a, b), {})
    again = memo(aten.add.Tensor, (torch.empty_like(a), torch.empty_like(b)), {})
    assert (memo.runs, memo.hits) == (1, 1)
    assert again is not first
    assert _layout(again) == _layout(first) == _layout(aten.add.Tensor(a, b))
    # a transposed argument is another call
    memo(aten.add.Tensor, (a.t().contiguous().t(), b), {})
    assert memo.runs == 2


def test_numbers_keep_their_type_in_the_key():
    memo = meta_memo.MetaMemo()
    t = torch.empty(3, dtype=torch.int64, device="meta")
    assert memo(aten.mul.Tensor, (t, torch.tensor(2, device="meta")), {}).dtype == torch.int64
    assert memo(aten.mul.Scalar, (t, 2), {}).dtype == torch.int64
    assert memo(aten.mul.Scalar, (t, 2.0), {}).dtype == torch.float32
    assert memo.hits == 0


def test_views_writes_and_tensors_off_meta_always_run():
    memo = meta_memo.MetaMemo()
    t = torch.empty(4, 6, device="meta")
    for _ in range(2):
        view = memo(aten.view.default, (t, [24]), {})
        assert view._base is t                     # a view still shares its input's storage
        memo(aten.add_.Tensor, (torch.empty(3, device="meta"), 1.0), {})
        memo(aten.add.Tensor, (torch.ones(3), torch.ones(3)), {})
    assert (memo.runs, memo.hits) == (6, 0)


def test_a_result_changed_by_its_caller_leaves_later_answers_alone():
    memo = meta_memo.MetaMemo()
    a = torch.empty(4, 6, device="meta")
    first = memo(aten.mul.Tensor, (a, a), {})
    first.resize_(100)
    assert tuple(memo(aten.mul.Tensor, (a, a), {}).shape) == (4, 6)
    assert memo.hits == 1


def _every_call_run(self, op, args, kwargs):
    """``MetaMemo.__call__`` as the code before the memo ran each op: every time."""
    self.runs += 1
    return op(*args, **kwargs)


def _fx_layouts(captured) -> list:
    return [(n.name, str(n.target), repr((n.args, n.kwargs)), _layouts(n.meta.get("val")))
            for n in captured.gm.graph.nodes]


def _layouts(val):
    if isinstance(val, (list, tuple)):
        return tuple(_layouts(v) for v in val)
    return _layout(val) if isinstance(val, torch.Tensor) else val


def test_a_step_derived_or_recorded_with_the_memo_is_the_one_made_without_it(monkeypatch):
    workload = zoo.tiny("llama", batch_size=4).replace(num_layers=3)
    with torch.device("meta"):
        model = workload.build()
    batch = workload.example_inputs(device="meta")
    whole = capture(model, batch, workload.loss_fn)
    made: list[meta_memo.MetaMemo] = []
    init = meta_memo.MetaMemo.__init__

    def kept(self):
        init(self)
        made.append(self)
    monkeypatch.setattr(meta_memo.MetaMemo, "__init__", kept)
    derived = rebatch.rebatched_capture(whole, 2, trust_numbers=True)
    recorded = record_step(model, batch, workload.loss_fn)
    assert len(made) == 2 and all(m.hits > 0 for m in made)   # layers 2 and 3 remembered
    monkeypatch.setattr(meta_memo.MetaMemo, "__call__", _every_call_run)
    plain = rebatch.rebatched_capture(whole, 2, trust_numbers=True)
    assert derived is not None and plain is not None
    assert rebatch.same_step(derived, plain)
    assert _fx_layouts(derived) == _fx_layouts(plain)
    assert recorded == record_step(model, batch, workload.loss_fn)

