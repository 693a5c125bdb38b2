"""Factor-based sharding rules: one declarative rule per op kind.

A rule names the *factors* of an op's iteration space (like einsum letters) and says
which factors index each dim of each operand and result. Sharding a factor over a mesh
axis shards every dim it indexes; operands it does not index stay replicated on that
axis; a *reduction* factor (contracted, summed or averaged away) leaves the results
``Partial``. A dim made of several factors (a reshape merged them) can be sharded only
by its leading (major) factor. Strategies are derived from rules by shared code
(``passes/sharding/strategies.py``); the ILP only selects among them.

Optional refinements cover ops that are not pure einsums:

- ``accumulators``: operands the op adds into (``index_put(accumulate=True)``'s and
  ``scatter_add``'s ``self``). On a mesh axis that shards a reduction factor such an operand
  does not index, it is read as ``Partial`` (each device adds its updates into its share)
  instead of ``Replicate`` (which would add the operand once per device).
- ``independent``: per result, the factors it does not depend on. On an axis sharding such a
  factor the result is computed whole on every device (``Replicate``) rather than being
  illegal. Results an op does not produce (``None`` outputs of backward ops with an
  ``output_mask``) list every factor.
- ``random``: the op draws random numbers (``rules/random.py``): each block of a sharded
  result is its own draw. ``AutoShardingOption(random="replicated")`` blocks every factor
  of such ops, for single-device numerics.
- ``synced``: factors the op may split although every result element depends on all of
  them, by computing per-row statistics in phases joined by all-reduces (Megatron's
  vocab-parallel softmax: the local max, all-reduced with max; the local sum of
  exponentials, all-reduced with sum). Each entry names the factor and the reduce op of
  each statistic, in order; a strategy splitting that factor over mesh axes lists those
  all-reduces (``Strategy.syncs``), the cost model prices them and the runtime issues them
  (``runtime/lowering/synced.py``). A statistic has the shape of the op's first result with that
  factor's dim reduced to 1; a synced factor that indexes no result (the fused
  cross-entropy's vocabulary) has statistics of the first result's shape and leaves the
  results whole (``Replicate``) on the axes that split it.
- ``batch_synced``: factors the op may split only by summing statistics across the devices
  that split them, in one all-reduce before the op's single local pass (training batch
  norm: per-channel sums over a split batch). Unlike ``synced`` there are no phases and
  the results the factors do not index are whole (``Replicate``) on their axes; the
  strategy records one sum all-reduce per such axis (``Strategy.batch_syncs``), of
  ``batch_sync_stats``: bytes per entry times the local size of the factors indexing the
  statistics. The runtime runs the op with those all-reduces (``runtime/lowering/sync_norm.py``).
  A rule has at most one of ``synced`` and ``batch_synced``.

A rule describes an op whose results are positional: one entry per output the op's schema
returns, ``None`` outputs included, so ``results[i]`` matches ``getitem(op, i)``.

Rules are registered per op name with ``@register``; ``rule_for`` looks one up. An op
without a rule gets ``None``, and the planner gives it a replicate-only strategy and
lists it in the plan (never a wrong result).

Modules:

- ``registry``: ``FactorRule``, ``@register``, ``rule_for``, ``FactorNamer``.
- ``common``: helpers for reading an op's arguments and placing operand dims.

and one module per op family:

- ``elementwise``: elementwise ops with broadcasting.
- ``matmul``: matrix products (the contracted factor leaves a Partial sum).
- ``reduce``: reductions and scans over some dims.
- ``softmax``: softmax and log-softmax, and their backward.
- ``norm``: layer norm and batch norm, forward and backward.
- ``loss``: negative log-likelihood (cross-entropy after log_softmax).
- ``embedding``: embedding lookup and its dense backward.
- ``sdpa``: scaled dot-product attention as one op.
- ``conv``: convolutions (1-, 2-, 3-d, grouped, transposed), forward and backward.
- ``pool``: pooling over the trailing spatial dims.
- ``resize``: upsampling the trailing spatial dims.
- ``view``: shape ops (reshape, permute, expand, squeeze).
- ``slicing``: ops that cut, join or reorder along one dim.
- ``index``: index- and order-driven ops (gather, scatter, sort, advanced indexing).
- ``factory``: ops that create tensors.
- ``random``: random ops: each device draws its own block.
- ``complex_ops``: complex views and FFTs.
- ``boundaries``: the pipeline-boundary marker.
"""

from torchalpa.passes.rules.registry import (
    RULES,
    Dims,
    FactorNamer,
    FactorRule,
    RuleFn,
    has_rule,
    normalize_dim,
    register,
    rule_for,
)

__all__ = ["FactorRule", "FactorNamer", "register", "rule_for", "RULES", "has_rule",
           "normalize_dim", "Dims", "RuleFn"]

# Populate the registry: one module per op family.
from torchalpa.passes.rules import (  # noqa: E402,F401
    boundaries,
    complex_ops,
    conv,
    elementwise,
    embedding,
    factory,
    index,
    loss,
    matmul,
    norm,
    pool,
    random,
    reduce,
    resize,
    sdpa,
    slicing,
    softmax,
    view,
)
