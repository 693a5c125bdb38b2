"""Small models shared by the tests (built from configs, random weights)."""

from __future__ import annotations

import torch
import torch.nn as nn


class MLP(nn.Module):
    """Alpa's test MLP: ``num_layers`` Linear(hidden, hidden) layers with a ReLU between."""

    def __init__(self, hidden: int, num_layers: int, bias: bool = True):
        super().__init__()
        layers = []
        for i in range(num_layers):
            layers.append(nn.Linear(hidden, hidden, bias=bias))
            if i < num_layers - 1:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


@torch.library.custom_op("torchalpa_test::scaled_tanh", mutates_args=())
def scaled_tanh(x: torch.Tensor) -> torch.Tensor:
    """An op torchalpa has no sharding rule for."""
    return torch.tanh(x) * 1.5


@scaled_tanh.register_fake
def _(x):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * 1.5 * (1 - torch.tanh(x) ** 2)


scaled_tanh.register_autograd(_backward, setup_context=_setup)


class WithCustomOp(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, hidden)
        self.fc2 = nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.fc2(scaled_tanh(self.fc1(x)))


def mlp_inputs(batch: int, hidden: int, device="cpu"):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, hidden, generator=g).to(device)
    y = torch.randn(batch, hidden, generator=g).to(device)
    return x, y
