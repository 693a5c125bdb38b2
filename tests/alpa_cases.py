"""Models of Alpa's ``tests/shard_parallel`` written the ways PyTorch users write them,
and helpers that read a Plan the way Alpa's assertions read an executable.

Alpa's cost units: a LogicalMesh with alpha = beta = 1 per axis (or as the test says);
fp32 tensors, so bytes = 4 x elements. Alpa's own ``all_reduce_cost`` adds 0.01 and its
all-gather 0.1 as tie-breakers; ours does not, far inside Alpa's 1% tolerance.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
from torchalpa import LogicalMesh, Replicate, ShardParallel

__all__ = ["assert_close", "plan_of", "mse", "MLP_SPELLINGS", "communication",
           "weights", "all_reduce_cost"]


def assert_close(x, y, rtol=0.01):
    """Alpa's ``assert_close``: within 1% (of the ratio)."""
    assert abs((x + 1e-9) / (y + 1e-9) - 1) <= rtol, f"{x} vs. {y}"


def all_reduce_cost(mesh: LogicalMesh, nbytes: float, axis: int) -> float:
    n = mesh.shape[axis]
    return mesh.alpha[axis] + mesh.beta[axis] * 2 * (n - 1) / n * nbytes


def mse(out, y):
    return ((out - y) ** 2).mean()


def plan_of(model, inputs, loss_fn=mse, *, shape, alpha=None, beta=None,
            method=ShardParallel, **options):
    """Plan on Alpa's logical mesh; ``options`` go to AutoShardingOption."""
    mesh = LogicalMesh(shape=shape, alpha=alpha, beta=beta)
    base = method().auto_sharding_option
    if method is ShardParallel:   # Alpa's default space: no reduce-scatter strategies
        options.setdefault("allow_reduce_scatter", False)
    from dataclasses import replace
    option = replace(base, **options)
    with torch.device("meta"):
        model = model() if callable(model) and not isinstance(model, nn.Module) else model
    model = torchalpa.to_meta(model)     # Module.to("meta") would untie shared weights
    inputs = tuple(t.to("meta") for t in inputs)
    plan = torchalpa.plan(model, inputs, loss_fn,
                          method=method(logical_mesh_shape=shape, auto_sharding_option=option),
                          cluster=mesh)
    return plan, mesh


def weights(plan) -> dict[str, tuple]:
    """Parameter name -> placements."""
    return {p.name: tuple(p.placements) for p in plan.parameters}


def communication(plan, *, ignore_scalar_all_reduce=False, merged_gradients=True) -> Counter:
    """Collectives per kind as Alpa's ``count_communication_primitives`` counts them in the
    compiled HLO, after XLA's combiners. Our runtime issues gradient collectives per
    bucket and a ZeRO plan's parameter gathers one per tensor; XLA merges them, so with
    ``merged_gradients`` (Alpa's default ``all_reduce_threshold`` of 2**60):

    * the gradients' collectives of one kind on one mesh axis count once (the all-reduce
      and reduce-scatter combiners, per replica group): the plan's merged all-reduces
      (``estimates['gradient_buckets']``, when ``all_reduce_threshold`` is set) and every
      gradient's bucketed collectives (those the runtime packs into buckets,
      ``runtime/rewrites/buckets.py``), merged per (kind, axis), and reduce-scatters per
      (axis, dim) too: XLA's combiner merges reduce-scatters of one scatter dim only
      (Alpa's 2D test counts "two reduce-scatter for two tensor dimensions");
    * the parameters' all-gathers count once per phase, axis and gathered dim (the
      all-gather combiner Alpa runs for ZeRO: one after the update, or with ZeRO-3 one for
      forward and one for backward; one per dim, as Alpa's 2D test counts them).

    Collectives on a mesh axis of size 1 move nothing and are not counted."""
    from torchalpa.runtime.rewrites.buckets import _grad_reshards as grad_reshards
    merged: dict[int, tuple] = {}
    if merged_gradients:
        for b in plan.estimates.gradient_buckets or ():
            merged.update((k, ("all_reduce", b["axis"])) for k in b["collectives"])
        for _, steps, positions in grad_reshards(plan):   # one gradient alone too
            merged.update((k, (step.kind, step.axis) + ((step.dim,) if step.kind ==
                                                            "reduce_scatter" else ()))
                          for step, k in zip(steps, positions))
        params = {p.node: p.placements for p in plan.parameters}
        for k, c in enumerate(plan.collectives):
            if c.kind == "all_gather" and c.tensor in params:
                merged[k] = ("all_gather", c.axis, c.phase,
                             getattr(params[c.tensor][c.axis], "dim", None))
    counts: Counter = Counter()
    groups = set()
    for k, c in enumerate(plan.collectives):
        if plan.mesh_shape[c.axis] == 1:
            continue
        if ignore_scalar_all_reduce and c.kind == "all_reduce" and c.bytes <= 4:
            continue
        if k in merged:
            groups.add(merged[k])
            continue
        counts[c.kind] += 1
    for group in groups:
        counts[group[0]] += 1
    counts["total"] = sum(v for k, v in counts.items() if k != "total")
    return counts


# -- Alpa's MLP: (num_layers - 1) x (Dense, relu), then Dense -------------------------------

class MLPModuleList(nn.Module):
    """nn.ModuleList of Linear layers, relu applied by the parent (functional)."""

    def __init__(self, num_layers, in_dim, hidden_dim, out_dim, bias=True):
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (num_layers - 1) + [out_dim]
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(dims, dims[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


class MLPSequential(nn.Module):
    """nn.Sequential of Linear and nn.ReLU modules."""

    def __init__(self, num_layers, in_dim, hidden_dim, out_dim, bias=True):
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (num_layers - 1) + [out_dim]
        mods = []
        for k, (a, b) in enumerate(zip(dims, dims[1:])):
            mods.append(nn.Linear(a, b, bias=bias))
            if k < num_layers - 1:
                mods.append(nn.ReLU())
        self.net = nn.Sequential(*mods)

    def forward(self, x):
        return self.net(x)


class MLPAttributes(nn.Module):
    """One attribute per layer (dense_0, dense_1, ...), torch.relu between them."""

    def __init__(self, num_layers, in_dim, hidden_dim, out_dim, bias=True):
        super().__init__()
        dims = [in_dim] + [hidden_dim] * (num_layers - 1) + [out_dim]
        self.num_layers = num_layers
        for k, (a, b) in enumerate(zip(dims, dims[1:])):
            setattr(self, f"dense_{k}", nn.Linear(a, b, bias=bias))

    def forward(self, x):
        for k in range(self.num_layers):
            x = getattr(self, f"dense_{k}")(x)
            if k < self.num_layers - 1:
                x = torch.relu(x)
        return x


MLP_SPELLINGS = {"modulelist": MLPModuleList, "sequential": MLPSequential,
                 "attributes": MLPAttributes}


def mlp_weight_names(model: nn.Module) -> list[str]:
    """Names of the Linear weights in layer order."""
    return [n for n, p in model.named_parameters() if p.ndim == 2]


R = Replicate()


# -- Alpa's BERT layers (FlaxBertLayerCollection): post-LN, gelu MLP of 4 x hidden ----------

class BertSelfAttention(nn.Module):
    """``qkv``: 'fused_minor' is Alpa's layout (one Linear to 3H, viewed as (H, 3) and
    split on the last dim: q, v, k interleaved per feature; 'fused_minor_split' cuts it
    with ``torch.split(.., 1, dim=3)`` as Flax's BERT does); 'fused_major' is the
    nanoGPT / GPT-2 spelling (viewed as (3, H)); 'separate' has three Linear layers.
    ``attention``: 'matmul', 'sdpa' or 'einsum' (Flax's)."""

    def __init__(self, hidden, heads, qkv, attention="matmul", dropout=0.0):
        super().__init__()
        self.heads, self.qkv_kind, self.attention = heads, qkv, attention
        # Flax BERT's dropouts: attention probs, dense output (none at rate 0)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.rate = dropout
        if qkv == "separate":
            self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        else:
            self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x, bias):
        B, S, H = x.shape
        if self.qkv_kind == "separate":
            q, k, v = self.query(x), self.key(x), self.value(x)
        elif self.qkv_kind == "fused_minor":
            q, v, k = self.qkv(x).view(B, S, H, 3).unbind(-1)            # (B, S, H) each
        elif self.qkv_kind == "fused_minor_split":                       # Flax's own spelling
            q, v, k = (t.reshape(B, S, H)
                       for t in torch.split(self.qkv(x).reshape(B, S, H, 3), 1, dim=3))
        else:
            q, k, v = self.qkv(x).split(H, dim=-1)
        if self.attention == "einsum":                                    # Flax's attention
            q, k, v = (t.reshape(B, S, self.heads, H // self.heads) for t in (q, k, v))
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (H // self.heads) ** 0.5 + bias
            ctx = torch.einsum("bhqk,bkhd->bqhd", self.drop(scores.softmax(-1)),
                               v).reshape(B, S, H)
            return self.norm(self.drop(self.out(ctx)) + x)
        q, k, v = (t.reshape(B, S, self.heads, H // self.heads).transpose(1, 2)
                   for t in (q, k, v))                                    # (B, nh, S, hd)
        if self.attention == "sdpa":
            ctx = F.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, dropout_p=self.rate if self.training else 0.0)
        else:
            scores = q @ k.transpose(-1, -2) / (H // self.heads) ** 0.5 + bias
            ctx = self.drop(scores.softmax(-1)) @ v                         # (B, nh, S, hd)
        ctx = ctx.transpose(1, 2).reshape(B, S, H)
        return self.norm(self.drop(self.out(ctx)) + x)


class BertLayer(nn.Module):
    def __init__(self, hidden, heads, qkv, attention, dropout=0.0):
        super().__init__()
        self.attention = BertSelfAttention(hidden, heads, qkv, attention, dropout)
        self.intermediate = nn.Linear(hidden, 4 * hidden)
        self.output = nn.Linear(4 * hidden, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()

    def forward(self, x, bias):
        x = self.attention(x, bias)
        return self.norm(self.drop(self.output(F.gelu(self.intermediate(x)))) + x)


class BertLayers(nn.Module):
    """Takes (hidden_states, attention_mask) as Alpa's test does; the mask (B, S) of 0/1
    becomes an additive bias. ``dropout``: Flax BERT's rate (Alpa's tests run it,
    ``deterministic=False``: 0.1); 0 leaves no dropout op in the graph."""

    def __init__(self, num_layers, hidden, heads, qkv="fused_minor", attention="matmul",
                 dropout=0.0):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(hidden, heads, qkv, attention, dropout)
                                   for _ in range(num_layers))

    def forward(self, x, mask):
        bias = torch.where(mask[:, None, None, :] > 0, 0.0, -1e10)      # (B, 1, 1, S)
        for layer in self.layer:
            x = layer(x, bias)
        return x


def bert_inputs(batch, seq, hidden):
    return (torch.empty(batch, seq, hidden), torch.ones(batch, seq, dtype=torch.int64),
            torch.empty(batch, seq, hidden))


def bert_matmul_weights(model: BertLayers, k: int) -> list[str]:
    """Alpa's four checked kernels of layer k: qkv, attention output, intermediate, output
    (with separate q/k/v, the three stand in for qkv)."""
    a = model.layer[k].attention
    first = ["query", "key", "value"] if hasattr(a, "query") else ["qkv"]
    return ([f"layer.{k}.attention.{n}.weight" for n in first]
            + [f"layer.{k}.attention.out.weight", f"layer.{k}.intermediate.weight",
               f"layer.{k}.output.weight"])


class TiedEmbedding(nn.Module):
    """Alpa's test_embedding_2d_mesh: logits = embed(x) @ embed.weight.T. ``head``:
    'matmul' (Alpa's spelling) or 'linear' (an ``nn.Linear`` head whose weight is the
    embedding's, as GPT-2 ties them)."""

    def __init__(self, vocab, hidden, head="matmul"):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.head = None
        if head == "linear":
            self.head = nn.Linear(hidden, vocab, bias=False)
            self.head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x)                                              # (B, S, H)
        return h @ self.embed.weight.T if self.head is None else self.head(h)   # (B, S, V)


def summed_cross_entropy(logits, y):
    """Alpa's loss there: -sum(one_hot(y) * log_softmax(logits))."""
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")


def summed_nll_of_log_softmax(logits, y):
    """The same loss spelled as log_softmax then nll_loss."""
    return F.nll_loss(F.log_softmax(logits, -1).flatten(0, 1), y.flatten(), reduction="sum")


# -- Alpa's conv net: num_layers x (3x3 stride-2 conv, BatchNorm, relu, 2x2 max pool) --------

class ConvNet(nn.Module):
    """NCHW; Flax's 'SAME' padding: the conv pads 1, the stride-1 pool pads right and
    bottom with -inf so the size is kept."""

    def __init__(self, num_layers, channel):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channel, channel, 3, stride=2, padding=1, bias=False),
                          nn.BatchNorm2d(channel), nn.ReLU())
            for _ in range(num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = F.max_pool2d(F.pad(layer(x), (0, 1, 0, 1), value=float("-inf")), 2, stride=1)
        return x


def conv_inputs(num_layers, batch, image, channel):
    out = image // 2 ** num_layers
    return torch.empty(batch, channel, image, image), torch.empty(batch, channel, out, out)


# -- Alpa's MoE layer (alpa/model/moe.py): BERT attention, then a top-2 gated MoE MLP ------

def top2_gating(gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Alpa's ``top2_gating`` (GShard's), op for op: gates (G, S, E) -> combine weights and
    dispatch mask (G, S, E, C), capacity C = 2S/E per expert and group."""
    G, S, E = gates.shape
    C = 2 * S // E
    index_1 = gates.argmax(-1)                                           # (G, S)
    mask_1 = F.one_hot(index_1, E).to(torch.int32)                       # (G, S, E)
    gate_1 = torch.einsum("gse,gse->gs", gates, mask_1.to(gates.dtype))
    gates_without_top_1 = gates * (1 - mask_1)
    index_2 = gates_without_top_1.argmax(-1)
    mask_2 = F.one_hot(index_2, E).to(torch.int32)
    gate_2 = torch.einsum("gse,gse->gs", gates_without_top_1, mask_2.to(gates.dtype))
    pos_1 = torch.cumsum(mask_1, dim=-2) - mask_1
    mask_1 = mask_1 * (pos_1 < C)
    pos_1 = (pos_1 * mask_1).sum(-1)                                     # (G, S)
    mask_1_count = mask_1.sum(-2)                                        # (G, E)
    mask_1_flat = mask_1.sum(-1)                                         # (G, S)
    pos_2 = torch.cumsum(mask_2, dim=-2) - mask_2 + mask_1_count.unsqueeze(-2)
    mask_2 = mask_2 * (pos_2 < C)
    pos_2 = (pos_2 * mask_2).sum(-1)
    mask_2_flat = mask_2.sum(-1)
    gate_1 = gate_1 * mask_1_flat
    gate_2 = gate_2 * mask_2_flat
    denom = gate_1 + gate_2
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    gate_1 = gate_1 / denom
    gate_2 = gate_2 / denom
    a = (gate_1 * mask_1_flat).unsqueeze(-1) * F.one_hot(index_1, E).to(gates.dtype)
    b = F.one_hot(pos_1.long(), C).to(gates.dtype)
    first = torch.einsum("gse,gsc->gsec", a, b)
    a = (gate_2 * mask_2_flat).unsqueeze(-1) * F.one_hot(index_2, E).to(gates.dtype)
    b = F.one_hot(pos_2.long(), C).to(gates.dtype)
    second = torch.einsum("gse,gsc->gsec", a, b)
    combined = first + second
    return combined, combined.bool()


class PositionWiseMoE(nn.Module):
    """Alpa's ``FlaxPositionWiseMoELayer``: gate ``wg`` (M, E), experts ``wi`` (E, M, H) and
    ``wo`` (E, H, M), tokens in groups of S."""

    def __init__(self, hidden, intermediate, group_size, num_experts):
        super().__init__()
        self.group_size = group_size
        self.wg = nn.Parameter(torch.randn(hidden, num_experts) / hidden ** 0.5)
        self.wi = nn.Parameter(torch.randn(num_experts, hidden, intermediate) / hidden ** 0.5)
        self.wo = nn.Parameter(torch.randn(num_experts, intermediate, hidden)
                               / intermediate ** 0.5)

    def forward(self, x):
        M = x.shape[-1]
        tokens = x.reshape(-1, self.group_size, M)                           # (G, S, M)
        gates = torch.einsum("gsm,me->gse", tokens, self.wg).softmax(-1)
        combined, dispatch = top2_gating(gates)
        dispatched = torch.einsum("gsec,gsm->egcm", dispatch.to(x.dtype), tokens)
        h = F.relu(torch.einsum("egcm,emh->egch", dispatched, self.wi))
        expert_out = torch.einsum("egch,ehm->gecm", h, self.wo)
        return torch.einsum("gsec,gecm->gsm", combined, expert_out).reshape(x.shape)


class MoELayer(nn.Module):
    """Alpa's ``FlaxMoELayer`` (deterministic: no dropout): BERT self-attention with its
    output dense and post-LN (Alpa's fused ``qvk_combined``), then the MoE MLP and post-LN.
    Takes (hidden_states, attention_mask) like Alpa's test."""

    def __init__(self, hidden, heads, group_size, num_experts):
        super().__init__()
        self.attention = BertSelfAttention(hidden, heads, "fused_minor")
        self.moe = PositionWiseMoE(hidden, 4 * hidden, group_size, num_experts)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x, mask):
        bias = torch.where(mask[:, None, None, :] > 0, 0.0, -1e10)        # (B, 1, 1, S)
        attention_output = self.attention(x, bias)
        return self.norm(self.moe(attention_output) + attention_output)


def all_to_all_cost(mesh: LogicalMesh, nbytes: float, axis: int) -> float:
    """Alpa's ``all_to_all_cost``: ``nbytes`` the whole tensor, a penalty of n / 2."""
    n = mesh.shape[axis]
    return mesh.alpha[axis] + mesh.beta[axis] * (n - 1) / n / n * nbytes * n / 2


# -- Alpa's test_basic models --------------------------------------------------------------

class DenseDropoutDense(nn.Module):
    """test_dropout: Dense(16, no bias), Dropout(0.1), Dense(16, no bias)."""

    def __init__(self, dim=16):
        super().__init__()
        self.dense_0 = nn.Linear(dim, 16, bias=False)
        self.dropout = nn.Dropout(0.1)
        self.dense_1 = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        return self.dense_1(self.dropout(self.dense_0(x)))


class DenseGatherDense(nn.Module):
    """test_gather: Dense(32, no bias), the first 16 features picked by an index array,
    Dense(16, no bias)."""

    def __init__(self, dim=32):
        super().__init__()
        self.dense_0 = nn.Linear(dim, 32, bias=False)
        self.dense_1 = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        idx = torch.arange(16, device=x.device)
        return self.dense_1(self.dense_0(x)[:, idx])


class Gemv(nn.Module):
    """test_gemv: a vector (128,) times a (128, 256) matrix."""

    def __init__(self):
        super().__init__()
        self.b = nn.Parameter(torch.randn(128, 256))

    def forward(self, a):
        return a @ self.b


class DotAllToAll(nn.Module):
    """test_mixed_2d's model: two Dense(16), the batch regrouped as (B, E, M/E) through
    per-expert weights ``wi`` (E, M/E, H) and ``wo`` (E, H, M/E) by einsum, then two
    Dense(16); no biases."""

    B, E, M, H = 256, 4, 16, 128

    def __init__(self):
        super().__init__()
        M, E, H = self.M, self.E, self.H
        self.dense0, self.dense1 = nn.Linear(M, M, bias=False), nn.Linear(M, M, bias=False)
        self.wi = nn.Parameter(torch.zeros(E, M // E, H))
        self.wo = nn.Parameter(torch.zeros(E, H, M // E))
        self.dense2, self.dense3 = nn.Linear(M, M, bias=False), nn.Linear(M, M, bias=False)

    def forward(self, x):
        x = self.dense1(self.dense0(x)).reshape(self.B, self.E, self.M // self.E)
        x = torch.einsum("BEM,EMH->EBH", x, self.wi)
        x = torch.einsum("EBH,EHM->BEM", x, self.wo)
        return self.dense3(self.dense2(x.reshape(self.B, self.M)))


# -- Alpa's BERT masked LM (FlaxBertForMaskedLMModule, tied decoder) ------------------------

class BertMLM(nn.Module):
    """Alpa's ``FlaxBertForMaskedLMModule``: word, position and token-type embeddings and
    a layer norm, the encoder (Alpa's layers, fused q/v/k), the prediction head's
    transform (dense, gelu, layer norm) and the decoder tied to the word embeddings
    (``x @ embedding.T + bias``)."""

    def __init__(self, num_layers, hidden, heads, vocab, seq_len, type_vocab=2):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(seq_len, hidden)
        self.token_type = nn.Embedding(type_vocab, hidden)
        self.norm = nn.LayerNorm(hidden, eps=1e-12)
        self.encoder = BertLayers(num_layers, hidden, heads)
        self.transform = nn.Linear(hidden, hidden)
        self.transform_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, input_ids, attention_mask, token_type_ids, position_ids):
        x = self.norm(self.word(input_ids) + self.position(position_ids)
                      + self.token_type(token_type_ids))
        x = self.encoder(x, attention_mask)
        x = self.transform_norm(F.gelu(self.transform(x)))
        return x @ self.word.weight.T + self.bias


def mlm_loss(logits, labels):
    """Alpa's run_bert_mlm loss: one-hot labels against log-softmax, masked where the
    label is 0, averaged over the labelled tokens, times 0.1234."""
    label_mask = (labels > 0).float()
    one_hot = F.one_hot(labels, logits.shape[-1]).float()
    loss = -(one_hot * F.log_softmax(logits, dim=-1)).sum(-1)
    return (label_mask * loss).sum() / label_mask.sum() * 0.1234


def mlm_inputs(batch, seq):
    ones = torch.ones(batch, seq, dtype=torch.int64)
    return (ones, ones, ones, ones, ones)    # input ids, mask, token types, positions, labels


class DepthwiseConvNet(nn.Module):
    """Alpa's test_n_layer_depthwise_conv model (NCHW, Flax's 'SAME' padding, no bias): a
    conv to 8C channels, a depthwise conv (one group per channel), a conv back to C, relu,
    BatchNorm."""

    def __init__(self, channel):
        super().__init__()
        wide = 8 * channel
        self.net = nn.Sequential(
            nn.Conv2d(channel, wide, 3, padding=1, bias=False),
            nn.Conv2d(wide, wide, 3, padding=1, groups=wide, bias=False),
            nn.Conv2d(wide, channel, 3, padding=1, bias=False), nn.ReLU(),
            nn.BatchNorm2d(channel))

    def forward(self, x):
        return self.net(x)
