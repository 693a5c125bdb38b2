"""Rematerialization (activation checkpointing) of a whole pipeline stage, at run time.

A stage the plan marks ``recompute`` (``StagePlan.recompute``, chosen per stage by the
pipeline search: ``passes/pipeline_search/stage_recompute.py``; ``ManualStageOption(recompute=...)`` forces it)
keeps nothing of a micro-batch's forward but
what the forward read: the activations it received from the previous stage (its own
slice of the batch the runner keeps anyway) and the random state the forward started
from. Right before that micro-batch's backward, the runner runs the stage's forward
program again on the same inputs, parameters and random state, and hands what it saved to
the backward program. The forward is deterministic given those, so the backward sees the
very values a kept forward would have saved: checkpointed training computes the same
numbers as plain training, at the price of one more forward per micro-batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["Replay", "random_state", "replaying"]


@dataclass
class Replay:
    """What a rematerialized stage keeps of micro-batch ``micro`` between its forward and
    backward: the received activations and the random state its forward began with."""

    micro: int
    received: list[torch.Tensor]
    rng: tuple


def random_state(device: torch.device | None) -> tuple:
    """The CPU generator's state and, on a CUDA device, that device's."""
    cuda = torch.cuda.get_rng_state(device) if device is not None and \
        device.type == "cuda" else None
    return torch.get_rng_state(), cuda


@contextlib.contextmanager
def replaying(rng: tuple, device: torch.device | None):
    """``with replaying(rng, device):`` runs its body from the random state ``rng``
    (``random_state``) and then puts back the state it found (``torch.random.fork_rng``),
    so the replay draws what the forward drew (dropout masks alike) and the later
    draws are not shifted."""
    cpu, cuda = rng
    with torch.random.fork_rng(devices=[device] if cuda is not None else []):
        torch.set_rng_state(cpu)
        if cuda is not None and device is not None:
            torch.cuda.set_rng_state(cuda, device)
        yield
