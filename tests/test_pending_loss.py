"""runtime/execution/pending_loss.py: the loop's loss while its all-reduce is in flight is
waited for on first read, not by ``loss.backward()``, and reads as the waited value."""

from __future__ import annotations

import torch

from torchalpa.runtime.execution.pending_loss import LossBox, PendingLoss


class _Step(torch.autograd.Function):
    """A stand-in for the training step: the loss pending, d(loss)/dw = 3."""

    @staticmethod
    def forward(ctx, w, box):
        del w
        ctx.box = box
        return PendingLoss(box, torch.empty((), dtype=torch.float32))

    @staticmethod
    def backward(ctx, grad):
        return 3 * grad * torch.ones(2), None


def _pending():
    waits = []

    def finish():
        waits.append(1)
        return torch.tensor(2.5)

    return LossBox(finish), waits


def test_backward_does_not_wait_and_the_value_is_made_once():
    box, waits = _pending()
    w = torch.zeros(2, requires_grad=True)
    loss = _Step.apply(w, box)
    assert isinstance(loss, PendingLoss) and loss.shape == () and loss.requires_grad
    loss.backward()
    assert waits == [] and torch.equal(w.grad, torch.full((2,), 3.0))
    assert loss.item() == 2.5
    assert waits == [1]                                  # once, however often it is read
    assert f"{loss:.2f}" == "2.50" and repr(loss) == "tensor(2.5000)"
    assert loss.tolist() == 2.5
    assert waits == [1]


def test_ops_on_it_read_the_value_and_return_plain_tensors():
    box, waits = _pending()
    loss = _Step.apply(torch.zeros(2, requires_grad=True), box)
    twice = loss * 2
    assert waits == [1] and type(twice) is torch.Tensor and twice.item() == 5.0
    assert twice.requires_grad                           # still part of the graph
    assert type(loss.detach()) is torch.Tensor and loss.detach().item() == 2.5
    assert bool(loss < 3) and torch.isfinite(loss).item()
    assert torch.stack([loss, loss]).tolist() == [2.5, 2.5]
