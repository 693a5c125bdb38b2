"""Local calls that need more than the global op (``runtime/lowering/localize.py``): here,
weight norm's backward, whose ATen kernel reads its operands as contiguous."""

from __future__ import annotations

import torch

from torchalpa.core.placement import Replicate
from torchalpa.core.plan import NodeStrategy
from torchalpa.runtime.lowering.localize import localize

aten = torch.ops.aten


def test_weight_norm_backward_reads_a_transposed_gradient_by_its_values():
    """A rank's block of the weight's gradient may come from a collective then a transpose
    (not contiguous); the traced step dropped autograd's ``grad.contiguous()``, and ATen's
    CPU kernel ignores strides (``nn.utils.parametrizations.weight_norm`` trained wrong on
    a 2 x 2 mesh). The local call gives the contiguous gradient's result."""
    graph = torch.fx.Graph()
    operands = [graph.placeholder(name) for name in ("grad_w", "v", "g", "norms")]
    node = graph.call_function(aten._weight_norm_interface_backward.default, (*operands, 0))
    whole = (Replicate(),)
    strategy = NodeStrategy(node.name, (whole,) * 4, (whole, whole))
    torch.manual_seed(0)
    v, g = torch.randn(32, 16), torch.randn(32, 1)
    norms = torch.linalg.vector_norm(v, 2, (1,), True)
    grad = torch.randn(16, 32).t()                          # (32, 16), transposed strides
    want = aten._weight_norm_interface_backward(grad.contiguous(), v, g, norms, 0)
    plain = aten._weight_norm_interface_backward(grad, v, g, norms, 0)
    assert not torch.allclose(plain[0], want[0])            # what the local call guards
    target, args, kwargs = localize(node, [grad, v, g, norms, 0], {}, strategy, (1,),
                                    torch.device("cpu"))
    got = target(*args, **kwargs)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
