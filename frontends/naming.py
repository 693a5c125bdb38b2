"""Names a person recognizes for the values of a captured step.

The example inputs are named after the parameters of ``model.forward`` (``input_ids``,
``labels``), the loss targets after ``loss_fn``'s parameters that follow the outputs;
where a signature cannot be read (``*args``, builtins) the name is ``input<i>`` /
``target<i>`` as before.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

__all__ = ["argument_names"]


def _positional(fn: Callable | None) -> list[str] | None:
    """Names of ``fn``'s positional parameters, or None if it takes ``*args``/has none."""
    if fn is None:
        return None
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def argument_names(model, loss_fn: Callable | None, num_inputs: int,
                   num_targets: int) -> list[str]:
    """One unique name per example input: model inputs first, then loss targets."""
    forward = _positional(getattr(model, "forward", None)) or []
    targets = (_positional(loss_fn) or [])[1:]       # the first takes the outputs
    names = [forward[i] if i < len(forward) else f"input{i}" for i in range(num_inputs)]
    names += [targets[i] if i < len(targets) else f"target{i}" for i in range(num_targets)]
    seen: set[str] = set()
    out = []
    for i, name in enumerate(names):
        if name in seen:
            name = f"{name}_{i}"
        seen.add(name)
        out.append(name)
    return out
