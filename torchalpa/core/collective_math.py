"""Collective arithmetic, in one place: what one collective costs (Alpa's alpha-beta forms)
and the bytes it puts on the wire. The cost model (``passes/pricing/cost.py``) prices with it, the
views (``plan.summary()``, the pictures) report with it.

For ``n`` ranks on a mesh axis with latency ``a`` and inverse bandwidth ``b``, where
``nbytes`` is what each rank contributes (a step's ``bytes``) and ``B`` the whole tensor
the collective produces or reduces (an all-gather's or all-to-all's ``B`` is ``n *
nbytes``; an all-reduce's and a reduce-scatter's is ``nbytes``):

=================  ==========================  ====================================
collective         seconds                     bytes on the wire, all ranks (ring)
=================  ==========================  ====================================
all-reduce         ``a + 2b (n-1)/n B``        ``2 (n-1) nbytes``
all-gather         ``a + b (n-1)/n B``         ``(n-1) n nbytes``
reduce-scatter     ``a + b (n-1)/n B``         ``(n-1) nbytes``
all-to-all         ``a + b (n-1)/n^2 B n/2``   ``(n-1) nbytes``
send/recv          ``a + b nbytes``            ``nbytes``
=================  ==========================  ====================================

On gloo a reduce-scatter is an all-reduce underneath: it costs and sends as much
(``benchmarks/collective_bytes.py`` measures it on loopback). ``sent_per_rank`` is the wire
bytes divided over the ranks (each rank of a ring sends the same), what ``summary()`` says
a rank sends and what gloo ranks put on loopback (``tests/test_summary_bytes.py``).
"""

from __future__ import annotations

__all__ = ["alpha_beta_seconds", "wire_bytes", "sent_per_rank", "FREE_KINDS"]

FREE_KINDS = ("slice", "partition")
"""Steps that only take a local block: no communication."""


def alpha_beta_seconds(kind: str, n: int, nbytes: float, alpha: float, beta: float,
                       backend: str = "nccl") -> float:
    """Seconds of one collective of ``kind`` over ``n`` ranks, each contributing
    ``nbytes``, on a link of latency ``alpha`` and inverse bandwidth ``beta``."""
    if n == 1 or kind in FREE_KINDS:
        return 0.0
    a, b = alpha, beta
    if kind == "all_reduce" or (kind == "reduce_scatter" and backend == "gloo"):
        return a + 2 * b * (n - 1) / n * nbytes
    if kind == "all_gather":
        return a + b * (n - 1) / n * (nbytes * n)
    if kind == "reduce_scatter":
        return a + b * (n - 1) / n * nbytes
    if kind == "all_to_all":
        return a + b * (n - 1) / n ** 2 * (nbytes * n) * (n / 2)
    if kind == "send_recv":
        return a + b * nbytes
    raise ValueError(f"unknown collective kind {kind!r}")


def wire_bytes(kind: str, n: int, nbytes: float, backend: str = "nccl") -> float:
    """Bytes one collective puts on the network, all ``n`` ranks together, for ring
    algorithms (``nbytes``: each rank's contribution)."""
    if n == 1 or kind in FREE_KINDS:
        return 0.0
    if kind == "all_reduce" or (kind == "reduce_scatter" and backend == "gloo"):
        return 2 * (n - 1) * nbytes
    if kind == "all_gather":
        return (n - 1) * n * nbytes
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) * nbytes
    if kind == "send_recv":
        return nbytes
    raise ValueError(f"unknown collective kind {kind!r}")


def sent_per_rank(kind: str, n: int, nbytes: float, backend: str = "nccl") -> float:
    """Bytes each of the ``n`` ranks sends for one collective (``wire_bytes`` / n; a
    send/recv's sender sends all of it)."""
    if kind == "send_recv":
        return wire_bytes(kind, n, nbytes, backend)
    return wire_bytes(kind, n, nbytes, backend) / n if n > 1 else 0.0
