"""runtime/rewrites/kept_buckets.py and release_inputs.py: a gradient bucket's flat buffer is
allocated once and reused every step, as DDP's buckets are (a fresh one each step faulted
in its pages anew), without ever overwriting a gradient the user still holds; the
backward program frees each saved value at its last use (tests/kept_buckets_worker.py on
2 gloo ranks)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.fx as fx
import worker_io

from torchalpa.runtime.rewrites.buckets import BUCKET, flatten_concat
from torchalpa.runtime.rewrites.kept_buckets import KeptBucket, keep_bucket_buffers
from torchalpa.runtime.rewrites.release_inputs import release_inputs


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("kept_buckets") / "kept_buckets.json"
    keys = ("loop:0", "train_step:0")
    return worker_io.launch_checked("kept_buckets_worker.py", out, ",".join(keys), nproc=2)


def test_the_loops_buckets_are_the_same_buffers_every_step(results):
    r = results["loop:0"]
    first, *later = r["storages"]
    assert all(s == first for s in later)       # no fresh bucket buffer after the first step
    assert r["distinct_storages"] < len(first)  # gradients are views of shared buckets
    assert max(r["grad_diff"]) < 1e-5           # and still one device's gradients


def test_train_step_alternates_between_two_kept_buffers(results):
    # the last step's gradients are still held while the next step packs: two buffers
    s = results["train_step:0"]["storages"]
    assert s[2] == s[0] and s[3] == s[1] and s[0] != s[1]


def test_a_gradient_the_user_keeps_is_not_overwritten(results):
    r = results["loop:0"]
    assert r["kept_unchanged"] and not r["kept_storage_reused"]


def test_gradients_accumulate_over_backward_calls_as_on_one_device(results):
    assert results["loop:0"]["accumulated_diff"] < 1e-5


def test_autograd_grad_inputs_and_hooks_see_the_gradients_as_autograd_gives_them(results):
    # the loop hands most gradients to the parameters itself (module._hand_over): only in
    # a backward over the whole graph, and never past a parameter's hook
    r = results["loop:0"]
    assert r["autograd_grad_diff"] < 1e-5 and r["autograd_grad_set_none"]
    assert r["inputs_only"] and r["hook_fired"]


def test_a_second_backward_of_one_step_is_refused_clearly(results):
    message = results["loop:0"]["second_backward"]
    assert message is not None and "backward already ran" in message \
        and "pmodel(x, y)" in message


def _bucket_program() -> fx.GraphModule:
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    flat = graph.call_function(flatten_concat, ([a, b],))
    flat.meta[BUCKET] = 0
    graph.output((graph.call_function(torch.mul, (flat, 2)),))
    return keep_bucket_buffers(fx.GraphModule(torch.nn.Module(), graph))


def test_kept_bucket_reuses_a_free_buffer_and_never_a_held_one():
    gm = _bucket_program()
    kept = next(n.target for n in gm.graph.nodes if isinstance(n.target, KeptBucket))
    a, b = torch.ones(3), torch.arange(2.0)
    flat = kept([a, b])
    assert torch.equal(flat, flatten_concat([a, b]))
    ptr = flat.data_ptr()
    del flat
    assert kept([a, b]).data_ptr() == ptr                   # free: the same buffer again
    view = kept([a, b])[:3]                                 # a view held: another buffer
    again = kept([2 * a, b])
    assert again.data_ptr() != view.data_ptr() and torch.equal(view, a)
    assert len(kept.buffers) == 2
    assert torch.equal(gm(a, b)[0], 2 * flatten_concat([a, b]))


def test_a_list_taking_program_frees_each_input_at_its_last_use():
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    s = graph.call_function(torch.sum, (x,))
    probe = graph.call_function(_alive, (s,))    # runs after x's last use
    graph.output((graph.call_function(torch.add, (y, probe)),))
    gm = release_inputs(fx.GraphModule(torch.nn.Module(), graph))
    inputs = [torch.ones(4), torch.zeros(2)]
    _WATCH.append(weakref.ref(inputs[0]))
    out = gm(inputs)
    assert inputs == [] and _SEEN == [False]        # the list emptied, x gone before the end
    assert torch.equal(out[0], torch.full((2,), 4.0))


_WATCH: list = []
_SEEN: list = []


def _alive(s):
    gc.collect()
    _SEEN.append(_WATCH[-1]() is not None)
    return s
