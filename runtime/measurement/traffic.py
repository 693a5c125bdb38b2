"""What this rank's collectives were handed, counted where they are issued, and their names
in a profiler's timeline.

Every collective a local program runs goes through one *issue* function of
``runtime.execution.collectives`` (the blocking versions, buckets, synced softmaxes and synchronized
batch norms included), and each of them calls ``issued`` here with the tensor it hands to
``torch.distributed``. That gives two things:

- ``TALLY``: per kind, how many collectives this process issued and the bytes of the
  tensors it passed (what the plan's ``bytes`` mean: each rank's contribution) and got back
  (an all-gather returns ``n`` times its input, a reduce-scatter ``1/n``). ``StepClock``
  reads it at the start and end of a step, so ``pm.last_step_stats()`` shows the bytes the
  step really moved next to the plan's list. Counting is a few integer additions per
  collective, always on; under ``torch.compile`` tracing nothing is counted (the compiled
  graph calls the collectives without coming back here).
- labels: while ``torch.profiler`` records, each issue runs inside
  ``record_function("torchalpa::<kind> axis <a> <bytes> B")`` and each wait inside
  ``"torchalpa::wait <kind>"``, so a Perfetto timeline tells the plan's communication from
  compute. ``label_axes`` names the mesh axes of the process groups (else ``group <name>``).

Pipeline stages exchange activations with ``torch.distributed``'s point-to-point calls
(``runtime.execution.pipeline``), which report here too (``point_to_point``): a send counts as one
``send_recv`` with its bytes sent, a receive adds its bytes received; labels
``torchalpa::send <bytes> B to rank <r>`` / ``torchalpa::recv <bytes> B from rank <r>``.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.autograd.profiler import record_function

__all__ = ["Traffic", "TALLY", "issued", "wait_label", "label_axes", "point_to_point"]


@dataclass
class Traffic:
    """Collectives issued per kind: how many, bytes handed in, bytes got back."""

    count: Counter = field(default_factory=Counter)
    sent: Counter = field(default_factory=Counter)
    received: Counter = field(default_factory=Counter)

    def copy(self) -> Traffic:
        return Traffic(Counter(self.count), Counter(self.sent), Counter(self.received))

    def since(self, earlier: Traffic) -> Traffic:
        """What was issued after ``earlier`` (a copy taken then)."""
        return Traffic(self.count - earlier.count, self.sent - earlier.sent,
                       self.received - earlier.received)


TALLY = Traffic()
"""Everything this process's collectives were handed since it started."""

_AXES: dict[str, str] = {}     # process-group name -> "axis 0 (dp)", for labels


def label_axes(mesh) -> None:
    """Name ``mesh``'s process groups after its axes in the profiler labels."""
    for i in range(mesh.ndim):
        name = f" ({mesh.mesh_dim_names[i]})" if mesh.mesh_dim_names else ""
        _AXES[mesh.get_group(i).group_name] = f"axis {i}{name}"


def _profiling() -> bool:
    return torch.autograd.profiler._is_profiler_enabled


def issued(kind: str, x: torch.Tensor, group_name: str, received_factor: float = 1.0):
    """Count one collective of ``kind`` handed ``x`` over ``group_name`` (its result holds
    ``received_factor`` times ``x``'s bytes); a context to issue it in (a profiler label
    while one records)."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    nbytes = x.nbytes
    TALLY.count[kind] += 1
    TALLY.sent[kind] += nbytes
    TALLY.received[kind] += int(nbytes * received_factor)
    if not _profiling():
        return contextlib.nullcontext()
    where = _AXES.get(group_name, f"group {group_name}")
    return record_function(f"torchalpa::{kind} {where} {nbytes} B")


def wait_label(kind: str):
    """A context to wait for a collective of ``kind`` in (a profiler label while one records)."""
    if torch.compiler.is_compiling() or not _profiling():
        return contextlib.nullcontext()
    return record_function(f"torchalpa::wait {kind}")


def point_to_point(direction: str, x: torch.Tensor, peer: int):
    """Count one pipeline ``"send"`` or ``"recv"`` of ``x`` with rank ``peer``; a context to
    run it in (a profiler label while one records)."""
    assert direction in ("send", "recv"), direction
    nbytes = x.nbytes
    if direction == "send":
        TALLY.count["send_recv"] += 1
        TALLY.sent["send_recv"] += nbytes
    else:
        TALLY.received["send_recv"] += nbytes
    if not _profiling():
        return contextlib.nullcontext()
    where = "to" if direction == "send" else "from"
    return record_function(f"torchalpa::{direction} {nbytes} B {where} rank {peer}")
