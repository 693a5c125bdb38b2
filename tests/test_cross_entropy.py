"""The fused cross-entropy (``torchalpa/ops/cross_entropy.py``): the loss and the logits'
gradient of ``F.cross_entropy``, chunked over tokens; captured as one op whose backward
reads the forward's per-token log-sum-exp; planned with tokens split; and trained like one
device on 4 gloo ranks (``tests/fused_ce_worker.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import worker_io

import torchalpa
import torchalpa.models as zoo
from torchalpa.frontends.torch_export import capture
from torchalpa.models.losses import fused_lm_loss, lm_loss
from torchalpa.ops import cross_entropy as fused
from torchalpa.ops.cross_entropy import cross_entropy


def _both(logits, targets, **kwargs):
    """(loss, gradient) of the fused op and of ``F.cross_entropy``, for one random
    incoming gradient (the same on every call)."""
    ours, ref = (logits.detach().clone().requires_grad_(True) for _ in range(2))
    loss = cross_entropy(ours, targets, **kwargs)
    ref_loss = F.cross_entropy(ref.flatten(0, -2), targets.flatten(), **kwargs)
    ref_loss = ref_loss.reshape(targets.shape) if kwargs.get("reduction") == "none" else ref_loss
    grad = torch.randn(ref_loss.shape, generator=torch.Generator().manual_seed(0))
    grad = grad.to(ref_loss.dtype)
    loss.backward(grad)
    ref_loss.backward(grad)
    return (loss, ours.grad), (ref_loss, ref.grad)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_and_gradient_equal_pytorch_in_float32(reduction, smoothing):
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 4
    targets = torch.randint(0, 11, (3, 5))
    targets[0, :2] = -100
    (loss, grad), (ref_loss, ref_grad) = _both(logits, targets, reduction=reduction,
                                               label_smoothing=smoothing)
    assert loss.dtype == ref_loss.dtype and loss.shape == ref_loss.shape
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grad, ref_grad)
    assert grad[0, :2].abs().max() == 0          # ignored rows get no gradient


def test_bfloat16_logits_get_a_bfloat16_gradient_as_close_as_pytorchs():
    """Against the float32 truth, the fused op (float32 inside) is within bf16's rounding,
    no farther than ``F.cross_entropy`` on the same bf16 logits."""
    torch.manual_seed(1)
    logits = (torch.randn(64, 300) * 3).bfloat16()
    targets = torch.randint(0, 300, (64,))
    (loss, grad), _ = _both(logits, targets)
    (_, _), (truth, true_grad) = _both(logits.float(), targets)
    (_, _), (bf_loss, bf_grad) = _both(logits, targets)
    assert grad.dtype == torch.bfloat16 and loss.dtype == torch.bfloat16
    ours, theirs = ((g.float() - true_grad).abs().max() for g in (grad, bf_grad))
    assert ours <= theirs * 1.01 + 1e-6
    assert abs(loss.float() - truth) <= abs(bf_loss.float() - truth) + 2 ** -7 * abs(truth)


def test_chunks_give_the_unchunked_result(monkeypatch):
    torch.manual_seed(2)
    logits, targets = torch.randn(37, 16), torch.randint(0, 16, (37,))
    whole = _both(logits, targets, label_smoothing=0.2)[0]
    monkeypatch.setattr(fused, "CHUNK_ELEMENTS", 5 * 16)      # 5 rows at a time: 8 chunks
    assert fused.chunk_rows(16) == 5
    chunked = _both(logits, targets, label_smoothing=0.2)[0]
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_backward_leaves_float32_logits_untouched():
    torch.manual_seed(3)
    logits, targets = torch.randn(6, 9), torch.randint(0, 9, (6,))
    losses, lse = torch.ops.torchalpa.cross_entropy(logits, targets, -100, 0.0)
    kept = logits.clone()
    torch.ops.torchalpa.cross_entropy_backward(torch.ones(6), logits, targets, lse, -100, 0.0)
    assert torch.equal(logits, kept)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_call_holds_no_more_than_its_stated_transient(monkeypatch, dtype):
    """Measured by the CPU allocator: beyond its result, a call allocates at most
    ``transient_bytes`` (and a few per-token vectors); float32 logits' backward computes in
    the gradient itself."""
    from torchalpa.runtime.measurement.allocated import peak_allocated
    monkeypatch.setattr(fused, "CHUNK_ELEMENTS", 64 * 1000)     # 64 rows: 4 chunks
    torch.manual_seed(5)
    logits, targets = torch.randn(256, 1000).to(dtype), torch.randint(0, 1000, (256,))
    grad_losses = torch.ones(256)
    losses, lse = torch.ops.torchalpa.cross_entropy(logits, targets, -100, 0.1)
    rows = 256 * 64                                              # per-token vectors
    forward = peak_allocated(lambda: torch.ops.torchalpa.cross_entropy(logits, targets, -100, 0.1))
    backward = peak_allocated(lambda: torch.ops.torchalpa.cross_entropy_backward(
        grad_losses, logits, targets, lse, -100, 0.1))
    grad_bytes = logits.numel() * logits.element_size()
    assert backward.peak - grad_bytes <= fused.transient_bytes(256, 1000, dtype, True) + rows
    assert forward.peak <= fused.transient_bytes(256, 1000, dtype, False) + rows
    assert fused.transient_bytes(256, 1000, dtype, True) == (0 if dtype == torch.float32
                                                             else 64 * 1000 * 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_of_the_vocabulary_with_reduced_statistics_give_the_whole_op(dtype):
    """The split form by hand on 4 blocks of columns: each statistic maxed or summed over
    the blocks (what the all-reduces do), finished on each block, equals the whole op's
    losses and lse; each block's backward is the whole gradient's columns."""
    torch.manual_seed(6)
    logits, targets = (torch.randn(10, 24) * 3).to(dtype), torch.randint(0, 24, (10,))
    targets[3] = -100
    whole_losses, whole_lse = torch.ops.torchalpa.cross_entropy(logits, targets, -100, 0.1)
    grad_losses = torch.randn(10)
    whole_grad = torch.ops.torchalpa.cross_entropy_backward(grad_losses, logits, targets,
                                                            whole_lse, -100, 0.1)
    blocks = [(logits[:, k:k + 6], targets, -100, 0.1, k, 24) for k in range(0, 24, 6)]
    m = torch.stack([fused.block_max(*b) for b in blocks]).amax(0)
    s = torch.stack([fused.block_sum_exp(*b, m) for b in blocks]).sum(0)
    linear = torch.stack([fused.block_linear(*b, m, s) for b in blocks]).sum(0)
    for b in blocks:
        losses, lse = fused.block_finish(*b, m, s, linear)
        torch.testing.assert_close(losses, whole_losses)
        torch.testing.assert_close(lse, whole_lse)
    grads = [fused.backward_block(grad_losses, b[0], targets, whole_lse, -100, 0.1, b[4], 24)
             for b in blocks]
    assert all(g.dtype == dtype for g in grads)
    torch.testing.assert_close(torch.cat(grads, 1), whole_grad)


def test_what_the_op_does_not_take_falls_back_to_pytorch():
    torch.manual_seed(4)
    logits, targets = torch.randn(8, 5), torch.randint(0, 5, (8,))
    weight, probs = torch.rand(5), torch.softmax(torch.randn(8, 5), -1)
    torch.testing.assert_close(cross_entropy(logits, targets, weight=weight),
                               F.cross_entropy(logits, targets, weight=weight))
    torch.testing.assert_close(cross_entropy(logits, probs), F.cross_entropy(logits, probs))
    torch.testing.assert_close(cross_entropy(logits[None], probs[None], reduction="none"),
                               F.cross_entropy(logits, probs, reduction="none")[None])


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_captured_step_saves_a_log_sum_exp_per_token_not_log_probabilities(family):
    w = zoo.tiny(family, loss="fused", vocab_size=96)
    assert w.loss_fn is fused_lm_loss
    assert zoo.tiny(family).loss_fn is lm_loss                # transformers' loss by default
    graph = capture(w.build(), w.example_inputs(), w.loss_fn).graph
    ops = {n.op for n in graph if n.kind == "op"}
    assert not any("log_softmax" in op or "nll_loss" in op for op in ops), ops
    forward = next(n for n in graph if n.op == fused.CROSS_ENTROPY_OP)
    backward = next(n for n in graph if n.op == fused.CROSS_ENTROPY_BACKWARD_OP)
    tokens = w.batch_size * w.config.max_seq_len
    assert [(o.shape, o.dtype) for o in forward.outputs] == [((tokens,), "float32")] * 2
    assert any(r.node == forward.name and r.index == 1 for r in backward.operands)
    assert backward.outputs[0].shape == (tokens, 96)
    assert forward.flops == fused.forward_flops(tokens, 96)
    assert backward.flops == fused.backward_flops(tokens, 96)


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="loss"):
        zoo.GPTConfig.tiny(loss="chunked")


def test_fused_loss_is_priced_below_eager_by_the_log_probabilities():
    """One device, float32: eager's backward holds the log-probabilities, the target's
    scattered gradient and their product; the fused op the logits and their gradient.
    The estimate drops by at least one tokens x vocabulary float32 tensor."""
    estimates = {}
    for loss in ("eager", "fused"):
        w = zoo.tiny("gpt", batch_size=4, loss=loss, vocab_size=2048, max_seq_len=64)
        with torch.device("meta"):
            model, batch = w.build(), w.example_inputs()
        plan = torchalpa.plan(model, batch, w.loss_fn, method=torchalpa.ShardParallel(),
                              cluster=torchalpa.Cluster.local_cpu(1))
        estimates[loss] = plan.estimates.memory_per_device_bytes
    one = 4 * 64 * 2048 * 4
    assert estimates["eager"] - estimates["fused"] >= 0.9 * one, estimates


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("fused_ce") / "fused_ce.json"
    return worker_io.launch_checked("fused_ce_worker.py", out, "shard:4,pipe:4,vocab:4,vocabpipe:4",
                                    nproc=4)


@pytest.mark.parametrize("scenario", ["shard:4", "pipe:4"])
def test_fused_loss_trains_like_one_device_eager_on_four_ranks(ranks, scenario):
    r = ranks[scenario]
    # tokens split on every axis of the stage's mesh, the vocabulary whole
    assert len(r["layouts"]) == 2 and all("Replicate" not in x for x in r["layouts"]), r
    for ours, ref in zip(r["losses"], r["ref_losses"], strict=True):
        assert ours == pytest.approx(ref, rel=1e-5)
    assert r["param_diff_to_scale"] < 1e-4
    if scenario == "shard:4":
        assert r["grad_rel_diff"] < 1e-4
        for executed, planned in zip(r["executed"], r["planned_per_step"], strict=True):
            assert executed == planned


def test_fused_loss_split_by_vocabulary_trains_like_one_device_on_four_ranks(ranks):
    """A tied head split by vocabulary on axis 1 of a 2 x 2 mesh: the fused loss (with
    ignore_index and label smoothing) reads its logits split by tokens and vocabulary and
    writes per-token results whole on the vocabulary axis (a max and two sums per token
    all-reduced inside it); its backward writes its block of columns; losses, gradients
    and parameters match one device's ``F.cross_entropy``; the collectives run are the
    plan's."""
    r = ranks["vocab:4"]
    split, tokens_only = "'(Shard(dim=0), Shard(dim=1))'", "'(Shard(dim=0), Replicate())'"
    forward, backward = r["layouts"]
    assert forward == f"[{split}, {tokens_only}] -> [{tokens_only}, {tokens_only}]", r
    assert backward.endswith(f"-> [{split}]"), r
    tokens = 8 * 6 // 2                                   # the batch split over axis 0
    for executed, planned in zip(r["executed"], r["planned_per_step"], strict=True):
        assert executed == planned
        assert executed.count(["all_reduce", 1, tokens * 4]) == 3      # the statistics
    for ours, ref in zip(r["losses"], r["ref_losses"], strict=True):
        assert ours == pytest.approx(ref, rel=1e-5)
    assert r["grad_rel_diff"] < 1e-4
    assert r["param_diff_to_scale"] < 1e-4


def test_fused_loss_split_by_vocabulary_in_a_pipeline_stage_trains_like_one_device(ranks):
    """A head pinned split by vocabulary in the second of two pipeline stages (2 ranks
    each): the planner splits the fused loss by vocabulary there (the per-token results
    whole), and training matches one device's ``F.cross_entropy`` with ignore_index and
    label smoothing."""
    r = ranks["vocabpipe:4"]
    forward, backward = r["layouts"]
    assert forward == ("['(Shard(dim=1),)', '(Replicate(),)'] -> "
                       "['(Replicate(),)', '(Replicate(),)']"), r
    assert backward.endswith("-> ['(Shard(dim=1),)']"), r
    for ours, ref in zip(r["losses"], r["ref_losses"], strict=True):
        assert ours == pytest.approx(ref, rel=1e-5)
    assert r["param_diff_to_scale"] < 1e-4
