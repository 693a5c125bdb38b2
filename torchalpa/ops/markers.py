"""``mark_pipeline_boundary``: where the user wants the pipeline cut between stages.

Alpa's JAX API marks stage boundaries with a call inside the model; this is the PyTorch
counterpart::

    def forward(self, x):
        x = self.first_half(x)
        x = torchalpa.mark_pipeline_boundary(x)
        return self.second_half(x)

On values it is the identity. In the captured graph it is one op,
``torchalpa::pipeline_boundary`` (``torchalpa.pipeline_boundary.default`` in the OpGraph),
in the forward on the marked activation and in the backward on its gradient (the op's
derivative is the same marker), so the pipeline pass can cut the layers there in both
directions. The op copies its input (custom ops may not return an alias of an input).
"""

from __future__ import annotations

import torch

__all__ = ["mark_pipeline_boundary", "PIPELINE_BOUNDARY_OP"]

PIPELINE_BOUNDARY_OP = "torchalpa.pipeline_boundary.default"


@torch.library.custom_op("torchalpa::pipeline_boundary", mutates_args=())
def _pipeline_boundary(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


@_pipeline_boundary.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    pass


def _backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    return _pipeline_boundary(grad)


_pipeline_boundary.register_autograd(_backward, setup_context=_setup_context)


def mark_pipeline_boundary(*tensors: torch.Tensor):
    """Mark the end of a pipeline stage; returns its argument(s) unchanged in value.

    Pass every tensor that crosses the boundary: ``x = mark_pipeline_boundary(x)`` or
    ``x, mask = mark_pipeline_boundary(x, mask)``.
    """
    if not tensors:
        raise TypeError("mark_pipeline_boundary() needs the tensor(s) that cross the boundary, "
                        "e.g. x = torchalpa.mark_pipeline_boundary(x)")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"mark_pipeline_boundary() argument {i} must be a tensor, "
                            f"got {type(t).__name__}")
    marked = tuple(_pipeline_boundary(t) for t in tensors)
    return marked[0] if len(marked) == 1 else marked
