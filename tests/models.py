"""Small models shared by the tests (built from configs, random weights)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


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


class FusedAttention(nn.Module):
    """nanoGPT's attention: one ``c_attn`` to 3H split into q, k and v (causal SDPA)."""

    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads, self.hidden = heads, hidden
        self.c_attn = nn.Linear(hidden, 3 * hidden)
        self.c_proj = nn.Linear(hidden, hidden)

    def forward(self, x):                          # (B, S, H)
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(self.hidden, dim=2)
        k = torch.tanh(k)   # else softmax cancels k's bias: its gradient would be noise
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(mixed.transpose(1, 2).reshape(b, s, h))


def fused_inputs(batch: int = 4):
    """(x, y) for ``FusedAttention``: (batch, 8, 32) each, the same every call."""
    gen = torch.Generator().manual_seed(4)
    return torch.randn(batch, 8, 32, generator=gen), torch.randn(batch, 8, 32, generator=gen)


def fused_attention_by_heads(num_devices: int = 4):
    """A method that holds ``FusedAttention`` split by heads (Megatron's layout) over
    ``num_devices`` in a row: c_attn a strided shard (each device its heads of q, of k and
    of v), c_proj split by rows."""
    import torchalpa
    from torchalpa.core.placement import strided
    pin = (("c_attn.weight", (strided(0, 3),)), ("c_proj.weight", (torchalpa.Shard(1),)))
    return torchalpa.ShardParallel(logical_mesh_shape=(num_devices,),
                                   auto_sharding_option=torchalpa.AutoShardingOption(pin=pin))


def mlp_inputs(batch: int, hidden: int, device="cpu"):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, hidden, generator=g).to(device)
    y = torch.randn(batch, hidden, generator=g).to(device)
    return x, y


class GroupedMoELayer(nn.Module):
    """GShard's MoE layer (as in Alpa's MoE tests): self-attention, then a top-2 routed
    mixture of experts whose dispatch keeps tokens in groups (one per sequence), so moving
    tokens from their group's device to their expert's device is an all-to-all."""

    def __init__(self, hidden: int, num_heads: int, num_experts: int, ffn: int,
                 capacity_factor: float = 2.0):
        super().__init__()
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.num_heads = num_heads
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(num_experts, hidden, ffn) * hidden ** -0.5)
        self.w_out = nn.Parameter(torch.randn(num_experts, ffn, hidden) * ffn ** -0.5)
        self.num_experts, self.capacity_factor = num_experts, capacity_factor

    def forward(self, x):                                                  # (G, S, M)
        G, S, M = x.shape
        E = self.num_experts
        q, k, v = self.qkv(x).view(G, S, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)                        # (G, heads, S, D)
        x = x + self.out(a.transpose(1, 2).reshape(G, S, M))
        probs = torch.softmax(self.gate(x), dim=-1)                        # (G, S, E)
        cap = int(2 * S * self.capacity_factor / E)
        weights, experts = probs.topk(2, dim=-1)                           # (G, S, 2)
        choice = F.one_hot(experts, E).to(x.dtype)                         # (G, S, 2, E)
        slot = (torch.cumsum(choice.flatten(1, 2), dim=1) - 1).view(G, S, 2, E)
        in_slot = F.one_hot((slot * choice).sum(-1).long(), cap).to(x.dtype)   # (G, S, 2, C)
        keep = (slot < cap).to(x.dtype) * choice
        dispatch = torch.einsum("gske,gskc->gsec", keep, in_slot)           # (G, S, E, C)
        combine = torch.einsum("gsk,gske,gskc->gsec", weights, keep, in_slot)
        expert_in = torch.einsum("gsec,gsm->egcm", dispatch, x)            # (E, G, C, M)
        h = F.gelu(torch.einsum("egcm,emf->egcf", expert_in, self.w_in))
        expert_out = torch.einsum("egcf,efm->egcm", h, self.w_out)          # (E, G, C, M)
        return x + torch.einsum("gsec,egcm->gsm", combine, expert_out)     # (G, S, M)
