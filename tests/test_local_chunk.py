"""A rank's block of a replicated tensor (``runtime.execution.collectives.local_chunk``, the plan's
"slice" step) is contiguous, as DTensor's local shards are.

Why it matters: torch's CPU ``native_layer_norm_backward`` computes a wrong weight
gradient, silently, when its saved ``mean`` or ``rstd`` is a view of a dim after the first.
Alpa's ``test_numerical_correctness`` (two BERT layers on a 2 x 2 mesh) hit it: the plan
ran layer 0's attention LayerNorm replicated and its backward split by batch and
sequence, slicing the saved statistics, and that layer's gradients came out 4-9% wrong
on 4 gloo ranks while the loss was right (``tests/test_alpa_runs.py``).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from torchalpa.runtime.execution.collectives import local_chunk


@pytest.mark.parametrize("dim", [0, 1, 2])
@pytest.mark.parametrize("split_factor", [1, 2])
def test_blocks_are_contiguous_and_tile_the_tensor(dim, split_factor):
    x = torch.arange(4 * 8 * 4, dtype=torch.float32).reshape(4, 8, 4)
    blocks = [local_chunk(x, dim, 2, i, split_factor) for i in range(2)]
    assert all(b.is_contiguous() for b in blocks)
    if split_factor == 1:
        assert torch.equal(torch.cat(blocks, dim), x)
    else:   # each rank holds its half of each of the two pieces
        pieces = [torch.cat([b.chunk(2, dim)[k] for b in blocks], dim) for k in range(2)]
        assert torch.equal(torch.cat(pieces, dim), x)


def test_layer_norm_backward_on_blocks_sums_to_the_whole():
    """The weight and bias gradients of LayerNorm's backward on every (batch, sequence)
    block of a 2 x 2 split add up to the unsplit op's."""
    g = torch.Generator().manual_seed(0)
    B, S, H = 8, 8, 32
    x, go = torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)
    w, b = torch.randn(H, generator=g), torch.randn(H, generator=g)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [H], w, b, 1e-5)
    whole = torch.ops.aten.native_layer_norm_backward(go, x, [H], mean, rstd, w, b,
                                                      [True, True, True])
    grad_w = grad_b = 0
    for i, j in itertools.product(range(2), range(2)):
        def block(t):
            return local_chunk(local_chunk(t, 0, 2, i), 1, 2, j)
        out = torch.ops.aten.native_layer_norm_backward(
            block(go), block(x), [H], block(mean), block(rstd), w, b, [True, True, True])
        assert torch.allclose(out[0], block(whole[0]), atol=1e-5)
        grad_w, grad_b = grad_w + out[1], grad_b + out[2]
    assert torch.allclose(grad_w, whole[1], atol=1e-4)
    assert torch.allclose(grad_b, whole[2], atol=1e-4)
