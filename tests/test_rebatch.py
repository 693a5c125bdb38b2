"""A micro-batch's step derived from the whole batch's capture (frontends/rebatch.py) is
the step traced at the micro-batch: the same nodes, shapes, costs, module paths and
generated code, and the same loss and gradients on real numbers, for the losses users
write (mean and summed MSE and cross-entropy, ignored targets, masked means, divisions by
the batch); what could hold the batch as a number is traced again instead, and a
derivation is trusted only once it matched a trace. AutoParallel's search traces the
model once (the whole batch; records of the step's ops at two counts, or else a trace of
the first micro-batch count, check the derivation) and plans as if it had traced each
count."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
import torchalpa.models as zoo
from torchalpa.frontends import rebatch
from torchalpa.frontends.rebatch_check import RecordCheck
from torchalpa.frontends.torch_export import capture, record_step
from torchalpa.parallel import auto


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


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 5)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _masked_mean(out, y):
    mask = (y >= 0).float()
    return (out[:, 0] ** 2 * mask).sum() / mask.sum()


# loss -> whether its targets are class indices (else regression targets like the output)
LOSSES = {
    "mse_mean": (F.mse_loss, False),
    "mse_sum": (lambda o, y: F.mse_loss(o, y, reduction="sum"), False),
    "l1_mean": (F.l1_loss, False),
    "cross_entropy_mean": (F.cross_entropy, True),
    "cross_entropy_sum": (lambda o, y: F.cross_entropy(o, y, reduction="sum"), True),
    "cross_entropy_ignore_index": (lambda o, y: F.cross_entropy(o, y, ignore_index=1), True),
    "masked_mean": (_masked_mean, True),
    "mean": (lambda o, y: o.mean(), False),
    "over_the_batch": (lambda o, y: o.sum() / o.shape[0], False),
    "over_numel": (lambda o, y: o.sum() / o.numel(), False),
    # a number no check on single numbers can tie to the batch: only the comparison with
    # a trace (MicroBatchSteps) finds it
    "over_three_batches": (lambda o, y: F.cross_entropy(o, y, reduction="sum")
                           / (o.shape[0] * 3), True),
}
BATCH = 12


def _mlp_step(loss: str, batch: int = BATCH):
    torch.manual_seed(0)
    model = _MLP()
    x = torch.randn(batch, 8)
    y = torch.randint(0, 5, (batch,)) if LOSSES[loss][1] else torch.randn(batch, 5)
    return model, (x, y), LOSSES[loss][0]


def _run(captured, model, inputs):
    """The step's loss and gradients on real numbers (the model's weights, ``inputs``)."""
    state = [dict(model.named_parameters())[n] for n in captured.param_names] + \
        [dict(model.named_buffers())[n] for n in captured.buffer_names]
    out = torch.fx.Interpreter(captured.gm).run(*state, *inputs)
    return [o for o in out if o is not None]


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_a_derived_step_is_the_traced_one_or_none(loss):
    """``rebatched_capture`` alone (its checks of single numbers): never a wrong step."""
    model, batch, loss_fn = _mlp_step(loss)
    whole = capture(model, batch, loss_fn)
    for k in (2, 3):
        traced = capture(model, tuple(x[: x.shape[0] // k] for x in batch), loss_fn)
        derived = rebatch.rebatched_capture(whole, k)
        if loss == "over_three_batches":
            continue             # below: what the comparison with a trace is for
        if loss in ("mse_mean", "mean", "over_the_batch", "over_numel", "l1_mean",
                    "masked_mean"):
            assert derived is None, loss        # a number the batch runs through
        if derived is not None:
            assert rebatch.same_step(derived, traced), loss


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_micro_batch_steps_are_the_traced_ones_in_graph_and_numbers(loss):
    """What the search uses: each count's step (traced or derived) is the one traced at
    that count, op for op and in its loss and gradients on real numbers."""
    model, batch, loss_fn = _mlp_step(loss)
    traces = []

    def trace(k):
        traces.append(k)
        return capture(model, tuple(x[: x.shape[0] // k] for x in batch), loss_fn)

    steps = rebatch.MicroBatchSteps(trace)
    for k in (1, 2, 3, 6):
        made = steps(k)
        traced = capture(model, tuple(x[: x.shape[0] // k] for x in batch), loss_fn)
        assert rebatch.same_step(made, traced), (loss, k)
        part = tuple(x[: x.shape[0] // k] for x in batch)
        for got, want in zip(_run(made, model, part), _run(traced, model, part), strict=True):
            assert torch.equal(got, want), (loss, k)
    if loss in ("mse_sum", "cross_entropy_sum", "cross_entropy_mean",
                "cross_entropy_ignore_index"):
        # nothing in these steps depends on the batch as a number: 1 traced, 2 traced and
        # checked, the rest derived
        assert traces == [1, 2] and steps.derived == {3, 6}, loss
        assert steps.how_made() == ("1, 2 traced, 3, 6 derived (checked by the trace at 2 "
                                    "micro-batches)"), loss
    if loss == "over_three_batches":      # the check finds 1 / 36 where 1 / 18 was traced
        assert steps.checked is False and steps.derived == set() and traces == [1, 2, 3, 6]
        assert steps.how_made().startswith("1, 2, 3, 6 traced (the derivation differed "
                                           "from the trace at 2 micro-batches"), loss
    if loss == "mse_mean":
        # the derivation trusts numbers (mse_loss's 2 / numel kept), the comparison with
        # the trace at 2 finds the number halved there, and nothing is derived
        assert steps.checked is False and steps.derived == set() and traces == [1, 2, 3, 6]


class _Rotary(nn.Module):
    """RoPE's frequencies: ``arange(0, head_dim, 2)``, head dim 8 -- the batch's size too."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        freqs = 1.0 / 10000 ** (torch.arange(0, 8, 2, device=x.device).float() / 8)
        return self.proj(x) * freqs.repeat(2)


def test_a_number_equal_to_the_batch_by_coincidence_is_derived_once_a_trace_agrees():
    torch.manual_seed(0)
    model, batch, loss_fn = _Rotary(), (torch.randn(8, 8), torch.randn(8, 8)), LOSSES["mse_sum"][0]
    assert rebatch.rebatched_capture(capture(model, batch, loss_fn), 2) is None   # 8: the batch?
    traces = []

    def trace(k):
        traces.append(k)
        return capture(model, tuple(x[: x.shape[0] // k] for x in batch), loss_fn)

    steps = rebatch.MicroBatchSteps(trace)
    for k in (1, 2, 4, 8):
        steps(k)
    assert traces == [1, 2] and steps.checked and steps.derived == {4, 8}
    for k in (4, 8):
        part = tuple(x[: x.shape[0] // k] for x in batch)
        traced = capture(model, part, loss_fn)
        assert rebatch.same_step(steps(k), traced), k
        for got, want in zip(_run(steps(k), model, part), _run(traced, model, part),
                             strict=True):
            assert torch.equal(got, want), k


@pytest.mark.parametrize("family", ["gpt", "llama", "bert"])
def test_the_zoo_losses_derive_the_traced_steps(family):
    workload = zoo.tiny(family, batch_size=6)
    with torch.device("meta"):
        model = workload.build()
    batch = workload.example_inputs(device="meta")

    def trace(k):
        return capture(model, tuple(x[: x.shape[0] // k] for x in batch), workload.loss_fn)

    steps = rebatch.MicroBatchSteps(trace)
    for k in (1, 2, 3, 6):
        steps(k)
    # batch 6: no size of these tiny models is a multiple of it (nothing refused by chance);
    # tiny BERT makes a constant of the batch's size (``full`` given 6), and is traced at
    # each count
    assert steps.derived == ({3, 6} if family != "bert" else set())
    for k in steps.derived:
        assert rebatch.same_step(steps(k), trace(k)), (family, k)
        assert steps(k).graph.spec(steps(k).graph.outputs.loss).shape == ()
    assert rebatch.rebatched_capture(steps(1), 1) is steps(1)


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
                for k in (1, 2, 3)]

    derived = plans()
    assert len(traces) == 1          # the whole batch; records of the ops check the rest
    monkeypatch.setattr(rebatch, "rebatched_capture", lambda captured, k, **_: None)
    traced = plans()
    assert len(traces) == 4          # without the derivation: one trace per count
    assert derived == traced


def test_every_step_the_search_hands_on_is_the_one_other_ranks_trace():
    """``auto_parallel``: rank 0 plans on (and lowers) the search's capture of the chosen
    count, every other rank traces that count itself (``build.chosen_capture``), and the
    fingerprints must match (``same_step_on_every_rank``). The quickstart MLP's
    ``mse_loss`` bakes ``2 / numel`` into its backward: a derived step that kept the whole
    batch's constant was another step than the one traced."""
    import importlib.util
    import pathlib
    from types import SimpleNamespace

    from torchalpa.parallel.build import chosen_capture
    from torchalpa.parallel.workflow import capture_examples

    path = pathlib.Path(__file__).parents[1] / "examples" / "quickstart.py"
    spec = importlib.util.spec_from_file_location("quickstart", path)
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    torch.manual_seed(0)
    model = quickstart.MLP(16, 4)
    batch = (torch.randn(8, 16), torch.randn(8, 16))
    cluster = torchalpa.Cluster.local_cpu(2)
    method = torchalpa.AutoParallel(remat=("none", "full"), pipeline=False,
                                    rematerialize_parameters=False)
    meshes = auto.AutoResolver().target(method, cluster=cluster, mesh=None, world=1,
                                        live=False).meshes
    searched: dict = {}
    session = auto.SearchSession(model, batch, F.mse_loss, method=method, cluster=cluster,
                                 meshes=meshes, allow_pipeline=False, captures=searched)
    for k in (1, 2, 4, 8):
        for remat in ("none", "full"):
            session.solve(auto.Candidate("intra-op", remat, k, 0.0, 0.0))
    assert len(searched) == 8
    for (k, remat, regather), captured in searched.items():
        option = SimpleNamespace(remat=remat, rematerialize_parameters=regather)
        other_rank = chosen_capture({}, model, capture_examples(model, batch, k), F.mse_loss,
                                    option, k, None)
        assert captured.graph.fingerprint() == other_rank.graph.fingerprint(), (k, remat)
        assert captured.gm.code == other_rank.gm.code, (k, remat)


def _checked_steps(model, batch, loss_fn):
    """``MicroBatchSteps`` as the search makes them (records check the derivation), and
    the counts it traced."""
    traces = []

    def part(k):
        return tuple(x[: x.shape[0] // k] for x in batch)

    def trace(k):
        traces.append(k)
        return capture(model, part(k), loss_fn)

    return rebatch.MicroBatchSteps(trace, RecordCheck(
        lambda k: record_step(model, part(k), loss_fn))), traces


# losses where a number in the step depends on the batch (the records must not vouch):
# a mean's scale, a division by the batch, or a sum's gradient broadcast to the batch
FROM_THE_BATCH = ("mse_mean", "l1_mean", "mean", "over_the_batch", "over_numel",
                  "over_three_batches", "masked_mean")


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_records_vouch_only_for_steps_that_are_the_traced_ones(loss):
    """A derivation the records vouch for is the step traced at each count (op for op and
    on real numbers), with the whole batch the only trace; where a number comes from the
    batch they do not vouch, and the trace at the first count decides, as before."""
    model, batch, loss_fn = _mlp_step(loss)
    steps, traces = _checked_steps(model, batch, loss_fn)
    for k in (1, 2, 3, 6):
        part = tuple(x[: x.shape[0] // k] for x in batch)
        traced = capture(model, part, loss_fn)
        assert rebatch.same_step(steps(k), traced), (loss, k)
        for got, want in zip(_run(steps(k), model, part), _run(traced, model, part),
                             strict=True):
            assert torch.equal(got, want), (loss, k)
    assert steps.vouched == (loss not in FROM_THE_BATCH), loss
    if steps.vouched:
        assert traces == [1] and steps.derived == {2, 3, 6}, loss
        assert steps.how_made() == ("1 traced, 2, 3, 6 derived (checked by records of the "
                                    "step's ops at two batch sizes)"), loss
    if loss in ("over_three_batches", "mse_mean"):
        assert traces == [1, 2, 3, 6] and steps.checked is False, loss


class _BatchConstant(nn.Module):
    """A tensor made from a Python number of the batch: a constant in one trace (inlined
    after it, so no recorded op holds it)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x) / torch.tensor(float(x.shape[0] * 3))


@pytest.mark.parametrize("module", [_Token, _Zeros, _BatchConstant, _Rotary])
def test_a_number_from_the_batch_never_slips_through_the_records(module):
    """What the records say of steps holding the batch as a number in every way the
    derivation keeps it (a broadcast to the batch, a constant's size, a constant's
    value), and of RoPE's ``arange(0, 8, 2)`` beside a batch of 8 (no number of the
    batch: vouched). Dropping the comparison of numbers would vouch for all four."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = module()
    batch = (torch.empty(8, 8, device="meta"), torch.empty(8, 8, device="meta"))
    whole = capture(model, batch, F.mse_loss)
    check = RecordCheck(lambda k: record_step(
        model, tuple(x[: x.shape[0] // k] for x in batch), F.mse_loss))
    reason = check(whole, 1, 2)
    # mse_loss's mean divides by the batch's numel: every module but RoPE's holds it too
    assert reason is not None, module
    sums = RecordCheck(lambda k: record_step(
        model, tuple(x[: x.shape[0] // k] for x in batch), LOSSES["mse_sum"][0]))
    whole = capture(model, batch, LOSSES["mse_sum"][0])
    assert (sums(whole, 1, 2) is None) == (module is _Rotary), module
    steps, traces = _checked_steps(model, batch, LOSSES["mse_sum"][0])
    for k in (1, 2, 4):
        assert rebatch.same_step(steps(k), capture(model, tuple(x[: 8 // k] for x in batch),
                                                   LOSSES["mse_sum"][0])), (module, k)
    assert steps.vouched == (module is _Rotary), module
    if module is _Rotary:
        assert traces == [1] and steps.derived == {2, 4}
