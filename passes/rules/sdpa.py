"""Scaled dot-product attention as one op, forward and backward.

The capture records ``F.scaled_dot_product_attention`` as the device-neutral
``torchalpa::sdpa`` (``torchalpa/ops/attention.py``); graphs traced elsewhere may hold the CPU
flash kernel ``aten._scaled_dot_product_flash_attention_for_cpu``. Both share the dims:
``q (B, Hq, L, E)``, ``k (B, Hk, S, E)``, ``v (B, Hk, S, Ev)`` -> ``out (B, Hq, L, Ev)``
(the CPU kernel also returns ``logsumexp (B, Hq, L)``). With grouped-query attention (``Hq = Hk * G``) query head
``h`` reads key/value head ``h // G``, so the query head dim is the merged factors
``(Hk, G)``: sharding the kv-head factor splits query heads and kv heads consistently.

- Batch and heads shard freely (Megatron's head-parallel attention).
- The key length ``S`` and the head dims ``E``, ``Ev`` are blocked: the softmax normalizes
  over all keys, and the scores contract the whole head dim.
- The query length ``L`` shards only without a causal mask: ``is_causal`` masks by global
  positions, which a device holding a block of queries would misalign. Sequence-parallel
  causal attention needs the positions' offset (ring attention), which a local op lacks.
- In the backward, key and value gradients sum over queries and query heads, so a sharded
  ``L`` (or query-group ``G``) leaves them Partial; all three gradients are linear in the
  incoming gradient.
- A learned additive mask (``torchalpa::sdpa_bias_backward``) gets a gradient summed over
  the dims it broadcasts along: those factors leave it Partial.
- With dropout inside the kernel (``dropout_p > 0``) every device would draw its own mask,
  so every factor is blocked (see ``rules/random.py``).

Without the fused kernel (meta tensors, other backends) attention traces as ``bmm`` and
``_softmax``, which have their own rules.
"""

from __future__ import annotations

from torchalpa.passes.rules.common import arg, positions
from torchalpa.passes.rules.registry import FactorNamer, register


class _Dims:
    """The factors of one attention call, and the dims of each of its tensors."""

    def __init__(self, f: FactorNamer, q, k, causal: bool, dropout: bool, v=None):
        (b, hq, l, e), (_, hk, s, _) = q, k
        block = dropout
        self.b = f.dims((b,), blocked=block)[0]
        self.kv_heads = f.dims((hk,), blocked=block)[0]
        self.group = f.dims((hq // hk,), blocked=block)[0]
        self.l = f.dims((l,), blocked=block or causal)[0]
        self.s = f.dims((s,), blocked=True)[0]
        self.e = f.dims((e,), blocked=True)[0]
        self.ev = self.e if v is None or v[-1] == e else f.dims((v[-1],), blocked=True)[0]
        self.q_heads = self.kv_heads + self.group

    def q(self):
        return (self.b, self.q_heads, self.l, self.e)

    def kv(self):
        return (self.b, self.kv_heads, self.s, self.e)

    def v(self):
        return (self.b, self.kv_heads, self.s, self.ev)

    def out(self):
        return (self.b, self.q_heads, self.l, self.ev)

    def lse(self):
        return (self.b, self.q_heads, self.l)

    def mask(self, shape):
        """An additive / boolean mask broadcast to (B, Hq, L, S), aligned from the right."""
        full = (self.b, self.q_heads, self.l, self.s)
        return tuple(full[j + 4 - len(shape)] if size != 1 else () for j, size in enumerate(shape))

    def broadcast(self, shape):
        """Factors of (B, Hq, L, S) that a mask of ``shape`` broadcasts along."""
        kept = {fac for dims in self.mask(shape) for fac in dims}
        return [fac for dims in (self.b, self.q_heads, self.l, self.s) for fac in dims
                if fac not in kept]


def _dims(node, specs, causal_index: int, dropout_index: int, q_slot: int):
    f = FactorNamer()
    q, k = specs[q_slot].shape, specs[q_slot + 1].shape
    causal = bool(arg(node, causal_index, "is_causal", False))
    dropout = (arg(node, dropout_index, "dropout_p", 0.0) or 0.0) > 0
    return f, _Dims(f, q, k, causal, dropout)


@register("aten._scaled_dot_product_flash_attention_for_cpu.default")
def flash_attention(node, specs):
    # (query, key, value, dropout_p, is_causal, *, attn_mask, scale) -> (out, logsumexp)
    f, d = _dims(node, specs, 4, 3, 0)
    table = {0: d.q(), 1: d.kv(), 2: d.kv()}
    operands = [table[key] if key in table else d.mask(spec.shape)
                for key, spec in zip(positions(node), specs)]
    return f.rule(operands, [d.q(), d.lse()], heavy=True)


@register("aten._scaled_dot_product_flash_attention_for_cpu_backward.default")
def flash_attention_backward(node, specs):
    # (grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask,
    #  scale) -> (grad_query, grad_key, grad_value)
    if len(specs[5].shape) != 3:
        return None  # not a logsumexp (B, Hq, L): a graph this rule does not describe
    f, d = _dims(node, specs, 7, 6, 1)
    table = {0: d.q(), 1: d.q(), 2: d.kv(), 3: d.kv(), 4: d.q(), 5: d.lse()}
    operands = [table[key] if key in table else d.mask(spec.shape)
                for key, spec in zip(positions(node), specs)]
    reductions = tuple((fac, "sum") for fac in d.l + d.group)
    return f.rule(operands, [d.q(), d.kv(), d.kv()], reductions=reductions,
                  linear=(frozenset({0}),), heavy=True)


# -- the device-neutral op (torchalpa/ops/attention.py) --------------------------------------

def _neutral_dims(node, specs, grad_slot: int):
    # (query, key, value, attn_mask, is_causal, scale, enable_gqa), after grad_out if any
    f = FactorNamer()
    q, k, v = (specs[grad_slot + i].shape for i in range(3))
    causal = bool(arg(node, grad_slot + 4, "is_causal", False))
    return f, _Dims(f, q, k, causal, dropout=False, v=v)


def _operands(node, specs, d, table):
    return [table[key] if key in table else d.mask(spec.shape)
            for key, spec in zip(positions(node), specs)]


@register("torchalpa.sdpa.default")
def sdpa(node, specs):
    f, d = _neutral_dims(node, specs, 0)
    operands = _operands(node, specs, d, {0: d.q(), 1: d.kv(), 2: d.v()})
    return f.rule(operands, [d.out()], heavy=True)


@register("torchalpa.sdpa_backward.default", "torchalpa.sdpa_bias_backward.default")
def sdpa_backward(node, specs):
    # (grad_out, query, key, value, attn_mask, is_causal, scale, enable_gqa)
    #   -> (grad_query, grad_key, grad_value[, grad_attn_mask])
    f, d = _neutral_dims(node, specs, 1)
    operands = _operands(node, specs, d, {0: d.out(), 1: d.q(), 2: d.kv(), 3: d.v()})
    results: list = [d.q(), d.kv(), d.v()]
    summed = list(d.l + d.group)
    if node.op == "torchalpa.sdpa_bias_backward.default":
        mask = specs[4].shape
        results.append(d.mask(mask))
        summed += [fac for fac in d.broadcast(mask) if fac not in summed]
    return f.rule(operands, results, reductions=tuple((fac, "sum") for fac in summed),
                  linear=(frozenset({0}),), heavy=True)
