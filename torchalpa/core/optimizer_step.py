"""How the runtime's optimizer step runs, and the temporaries it allocates: one answer
for the runtime, which picks the implementation, and the memory model, which prices it.

``torch.optim``'s elementwise optimizers update either tensor by tensor (a Python loop,
the per-parameter implementation) or every tensor of a group at once (``foreach``).
Both allocate temporaries beside the parameters, gradients and states:

- Adam / AdamW, tensor by tensor: ``denom = (exp_avg_sq.sqrt() / c).add_(eps)`` holds the
  square root and the quotient, two copies of the parameter being updated, at once; all
  of them at once (``_foreach_sqrt`` of every state) with ``foreach``;
- Adagrad, RMSprop: one square root (``state_sum.sqrt()``, ``square_avg.sqrt()``), of one
  parameter or of all;
- SGD (with or without momentum): none (momentum's buffer is a state, updated in place).

(Weight decay in Adam's own form, ``grad.add(param)``, adds one copy more; AdamW decays in
place. The plan does not know the user's hyper-parameters and prices none.)

Which implementation runs: on GPUs ``torch.optim``'s default, ``foreach``; on CPU the
runtime (``runtime/execution/optim.py``) switches a group the user left at the default to
``foreach`` only while its tensors are small (``FOREACH_MAX_NUMEL`` each,
``FOREACH_MAX_GROUP_NUMEL`` together: larger ones step faster one by one), else the loop.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["FOREACH_MAX_NUMEL", "FOREACH_MAX_GROUP_NUMEL", "LOOP_TEMPORARIES",
           "FOREACH_TEMPORARIES", "steps_foreach", "optimizer_temporary_bytes"]

FOREACH_MAX_NUMEL = 2 ** 20      # larger CPU tensors step faster one by one
FOREACH_MAX_GROUP_NUMEL = 2 ** 19   # larger CPU groups too

LOOP_TEMPORARIES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd_momentum": 0, "adagrad": 1,
                    "rmsprop": 1}
"""Copies of the parameter being updated that the tensor-by-tensor step holds at once."""

FOREACH_TEMPORARIES = {"adam": 1, "adamw": 1, "sgd": 0, "sgd_momentum": 0, "adagrad": 1,
                       "rmsprop": 1}
"""Copies of every parameter of the group that the ``foreach`` step holds at once."""


def steps_foreach(numels: Sequence[int], device_type: str) -> bool:
    """Whether a group of tensors of ``numels`` elements steps with ``foreach`` where the
    user left the choice open: always on GPUs (torch's default), on CPU while small."""
    if device_type != "cpu":
        return True
    return bool(numels) and max(numels) <= FOREACH_MAX_NUMEL \
        and sum(numels) <= FOREACH_MAX_GROUP_NUMEL


def optimizer_temporary_bytes(optimizer: str, local: Sequence[tuple[int, int]],
                              device_type: str) -> int:
    """Bytes of temporaries one device's optimizer step holds at its peak, its trained
    parameters' local blocks being ``local`` ((elements, bytes) each; one group)."""
    if not local:
        return 0
    if steps_foreach([n for n, _ in local], device_type):
        return FOREACH_TEMPORARIES.get(optimizer, 1) * sum(b for _, b in local)
    return LOOP_TEMPORARIES.get(optimizer, 2) * max(b for _, b in local)
