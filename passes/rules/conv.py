"""Convolution forward and backward (1-, 2- and 3-d, grouped and transposed).

``conv(input (N, Cin, *X), weight (Cout, Cin/G, *K), bias (Cout,)) -> (N, Cout, *Y)``:

- ``N`` shards freely (data parallel); ``Cout`` shards weight, bias and output channels;
  ``Cin`` is contracted, so sharding it leaves a Partial sum. That is illegal with a bias
  (it would be added once per device): the frontend's ``addmm``-style split of bias from
  the product would make it legal.
- With ``G > 1`` groups the channel dims are ``(G, C/G)``: sharding the group factor keeps
  whole groups on each device (``runtime/lowering/localize.py`` divides ``groups``).
- Spatial dims are blocked unless the kernel is 1 with stride 1 and no padding (then the
  op is pointwise in space): a device holding a block of rows would need its neighbours'
  halo rows.
- Transposed convolutions (weight ``(Cin, Cout/G, *K)``) shard the same way.

``convolution_backward`` returns ``(grad_input, grad_weight, grad_bias)`` (entries the
output mask leaves out are ``None``): ``N`` and pointwise spatial dims are summed into
the weight and bias gradients, ``Cout`` into the input gradient (Partial when sharded);
the bias gradient does not depend on ``Cin``. All three are linear in ``grad_output``.
"""

from __future__ import annotations

from torchalpa.passes.rules.common import arg, positions
from torchalpa.passes.rules.registry import FactorNamer, register


def _pointwise_in_space(node, spatial: int, offset: int) -> list[bool]:
    """Per spatial dim: kernel 1, stride 1, no padding (args start at ``offset``)."""
    stride, padding, _, transposed, output_padding = (arg(node, offset + i) for i in range(5))
    return [all(_at(v, i) == want for v, want in ((stride, 1), (padding, 0), (output_padding, 0)))
            for i in range(spatial)]


def _at(value, i):
    if value is None:
        return 0
    if isinstance(value, (tuple, list)):    # one entry per dim, or one for all
        return value[i if len(value) > 1 else 0]
    return value


class _Conv:
    """Factors of one convolution and the dims of its tensors."""

    def __init__(self, f: FactorNamer, node, x, w, y, offset: int, has_bias: bool):
        groups = int(arg(node, offset + 5, "groups", 1))
        transposed = bool(arg(node, offset + 3, "transposed", False))
        cin, cout = x[1], y[1]
        kernel = w[2:]
        unit = _pointwise_in_space(node, len(kernel), offset)
        point = [k == 1 and p for k, p in zip(kernel, unit)]
        self.n = f.dims((x[0],))[0]
        self.g = f.dims((groups,))[0]
        self.cin = f.dims((cin // groups,), blocked=has_bias and groups == 1)[0]
        self.cout = f.dims((cout // groups,))[0]
        self.x_space, self.y_space, self.k_space = [], [], []
        for i, (xs, ys, ks) in enumerate(zip(x[2:], y[2:], kernel)):
            if point[i] and xs == ys:
                fac = f.dims((xs,))[0]
                self.x_space.append(fac)
                self.y_space.append(fac)
            else:
                self.x_space.append(f.dims((xs,), blocked=True)[0])
                self.y_space.append(f.dims((ys,), blocked=True)[0])
            self.k_space.append(f.dims((ks,), blocked=True)[0])
        self.transposed = transposed

    def x(self):
        return (self.n, self.g + self.cin) + tuple(self.x_space)

    def y(self):
        return (self.n, self.g + self.cout) + tuple(self.y_space)

    def w(self):
        if self.transposed:
            return (self.g + self.cin, self.cout) + tuple(self.k_space)
        return (self.g + self.cout, self.cin) + tuple(self.k_space)

    def bias(self):
        return (self.g + self.cout,)

    def pointwise_space(self):
        return [fac for xs, ys in zip(self.x_space, self.y_space) if xs == ys for fac in xs]


@register("aten.convolution.default")
def convolution(node, specs):
    # (input, weight, bias?, stride, padding, dilation, transposed, output_padding, groups)
    has_bias = 2 in positions(node)
    f = FactorNamer()
    c = _Conv(f, node, specs[0].shape, specs[1].shape, node.outputs[0].shape, 3, has_bias)
    table = {0: c.x(), 1: c.w(), 2: c.bias()}
    reductions = tuple((fac, "sum") for fac in c.cin)
    return f.rule([table[key] for key in positions(node)], [c.y()], reductions=reductions,
                  linear=(frozenset({0}), frozenset({1})) if not has_bias else (), heavy=True)


@register("aten.convolution_backward.default")
def convolution_backward(node, specs):
    # (grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    #  output_padding, groups, output_mask) -> (grad_input, grad_weight, grad_bias)
    grad_y, x, w = (s.shape for s in specs[:3])
    f = FactorNamer()
    c = _Conv(f, node, x, w, grad_y, 4, has_bias=False)
    mask = arg(node, 10, "output_mask", (True, True, True))
    summed_out = c.n + tuple(c.pointwise_space())
    reductions = tuple((fac, "sum") for fac in summed_out + c.cout)
    absent = f.all()
    independent = (frozenset() if mask[0] else absent, frozenset() if mask[1] else absent,
                   frozenset(c.cin) if mask[2] else absent)
    return f.rule([c.y(), c.x(), c.w()], [c.x(), c.w(), c.bias()], reductions=reductions,
                  linear=(frozenset({0}),), independent=independent, heavy=True)
