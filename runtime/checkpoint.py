"""Checkpoints of a ParallelModule and its optimizer with ``torch.distributed.checkpoint``.

Thin wrappers over DCP: the state dicts come from ``get_state_dict`` (parameter FQNs as
the user's model names them, optimizer state keyed by those FQNs) and hold DTensors, so
every rank writes only its own blocks, and a checkpoint loads into any mesh or plan --
another mesh shape, another world size, another layout per parameter -- with DCP
resharding on load. The same model and plan resume bit-identically.

Both functions are collective: every rank calls them with the same path.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

__all__ = ["save_checkpoint", "load_checkpoint"]


def _parts(pmodel, optimizer):
    from torchalpa.runtime.module import ParallelModule
    from torchalpa.runtime.pipeline_module import PipelineModule
    if not isinstance(pmodel, (ParallelModule, PipelineModule)):
        raise TypeError(f"expected the ParallelModule returned by auto_parallel, got "
                        f"{type(pmodel).__name__}")
    optimizer = optimizer if optimizer is not None else pmodel.optimizer
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    return pmodel.module, optimizer


def save_checkpoint(path: str | os.PathLike, pmodel, optimizer=None) -> None:
    """Save the model's parameters and buffers (and the optimizer's state) under ``path``.

    ``optimizer`` defaults to ``pmodel.optimizer`` (the one given to ``auto_parallel``).
    """
    module, optimizer = _parts(pmodel, optimizer)
    if optimizer is None:
        state = {"model": get_model_state_dict(module)}
    else:
        model_sd, optim_sd = get_state_dict(module, optimizer)
        state = {"model": model_sd, "optimizer": optim_sd}
    dcp.save(state, checkpoint_id=os.fspath(path))


def load_checkpoint(path: str | os.PathLike, pmodel, optimizer=None) -> None:
    """Load a checkpoint made by ``save_checkpoint`` into ``pmodel`` (and the optimizer),
    whatever mesh and plan it was saved with.

    The optimizer's state is created first if it has none (a zero-learning-rate step, as
    ``torch.distributed.checkpoint.state_dict`` does), then overwritten by the saved one.
    """
    module, optimizer = _parts(pmodel, optimizer)
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise ValueError(f"no checkpoint at {path!r} (save_checkpoint writes a directory)")
    if optimizer is None:
        state = {"model": get_model_state_dict(module)}
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(module, state["model"])
        return
    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(module, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
