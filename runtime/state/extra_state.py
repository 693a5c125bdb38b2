"""A checkpoint's extra state (``nn.Module.get_extra_state``), set before anything else.

A module's ``set_extra_state`` may check what it is given and refuse it (a layer that
records its format version). ``torch``'s ``load_state_dict`` calls it last for each
module, after that module's parameters, and ``set_state_dict`` loads the optimizer
before the model: a refusal there arrives with the optimizer and most parameters
already overwritten. So ``load_checkpoint`` sets every module's extra state first
(``set_all``): if one refuses, the modules set before it get back the state they had,
and every rank hears of the refusal before any tensor is applied; then the tensors are
loaded without the extra-state entries (they are set already).

Only the extra state of modules found by their state-dict name is handled here; an
entry whose module is not found is left in the state dict, for ``load_state_dict``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch.nn as nn

__all__ = ["split", "set_all", "restore"]

_SUFFIX = nn.modules.module._EXTRA_STATE_KEY_SUFFIX          # "_extra_state"


def _owner(module: nn.Module, key: str) -> nn.Module | None:
    """The submodule whose extra state ``key`` is (None if ``key`` is none, or not found)."""
    if key != _SUFFIX and not key.endswith("." + _SUFFIX):
        return None
    path = key[:-len(_SUFFIX)].rstrip(".")
    try:
        owner = module.get_submodule(path)
    except AttributeError:
        return None
    overridden = type(owner).set_extra_state is not nn.Module.set_extra_state
    return owner if overridden else None


def split(module: nn.Module, model_state: dict) -> tuple[dict, list[tuple[str, nn.Module, Any]]]:
    """``model_state`` without the extra-state entries of ``module``'s submodules, and
    those entries as ``(key, submodule, saved state)``."""
    rest, extras = {}, []
    for key, value in model_state.items():
        owner = _owner(module, key)
        if owner is None:
            rest[key] = value
        else:
            extras.append((key, owner, value))
    return rest, extras


def _current(owner: nn.Module) -> Any:
    state = owner.get_extra_state()
    try:
        return copy.deepcopy(state)      # the module may change the object it returned
    except Exception:  # not copyable: the object itself is the best record there is
        return state


def set_all(extras: list[tuple[str, nn.Module, Any]]) -> tuple[list, str | None]:
    """Set each module's saved extra state, in order; stop at the first refusal. Returns
    what was set, as ``(submodule, previous state)`` for ``restore``, and the refusal (a
    message naming the module) or None."""
    applied: list[tuple[nn.Module, Any]] = []
    for key, owner, saved in extras:
        previous = _current(owner)
        try:
            owner.set_extra_state(saved)
        except Exception as e:  # the module refused it: what the caller reports
            restore(applied)
            name = key[:-len(_SUFFIX)].rstrip(".") or "the model itself"
            first = (str(e).strip().splitlines() or [""])[0][:300]
            return [], (f"module {name!r} ({type(owner).__name__}) refused its saved extra "
                        f"state in set_extra_state ({type(e).__name__}: {first})")
        applied.append((owner, previous))
    return applied, None


def restore(applied: list[tuple[nn.Module, Any]]) -> None:
    """Give each module of ``applied`` its previous extra state back, the last set first."""
    for owner, previous in reversed(applied):
        owner.set_extra_state(previous)
