"""Complex numbers: the real <-> complex views and the FFTs.

Rotary embeddings written with complex numbers (Llama 4's ``view_as_complex(x) * freqs_cis``
then ``view_as_real``) and FNet's Fourier mixing (``torch.fft.fftn``) make complex values in
the middle of a real model; the elementwise ops on them (``mul``, ``polar``, ``_conj``) are
ordinary pointwise rules (``rules/elementwise.py``).

``view_as_complex`` reads the trailing (real, imaginary) pair of a real tensor as one
complex element, and ``view_as_real`` does the reverse: every other dim shards freely,
the pair dim has no factor (it is never split). An FFT over ``dim`` mixes all positions
along those dims, which are blocked; the other dims shard freely, and the transform is
linear, so a ``Partial`` input gives a ``Partial`` output.
"""

from __future__ import annotations

from torchalpa.passes.rules.common import arg, dim_list
from torchalpa.passes.rules.registry import FactorNamer, register

__all__ = ["view_as_complex", "view_as_real", "fft"]

_LINEAR = (frozenset({0}),)


@register("aten.view_as_complex.default")
def view_as_complex(node, specs):
    # (..., 2) real -> (...) complex
    f = FactorNamer()
    lead = f.dims(node.outputs[0].shape)
    return f.rule([lead + ((),)], [lead], linear=_LINEAR)


@register("aten.view_as_real.default")
def view_as_real(node, specs):
    # (...) complex -> (..., 2) real
    f = FactorNamer()
    lead = f.dims(specs[0].shape)
    return f.rule([lead], [lead + ((),)], linear=_LINEAR)


@register("aten._fft_c2c.default", "aten._fft_r2c.default", "aten._fft_c2r.default")
def fft(node, specs):
    # (input, dim, normalization, forward | onesided | last_dim_size) -> the transform
    shape, out = specs[0].shape, node.outputs[0].shape
    mixed = set(dim_list(arg(node, 1, "dim"), len(shape)) or range(len(shape)))
    f = FactorNamer()
    x, y = [], []
    for d, (size, out_size) in enumerate(zip(shape, out)):
        if d in mixed:                                  # transformed: blocked, may resize
            x.append(f.dims([size], blocked=True)[0])
            y.append(f.dims([out_size], blocked=True)[0])
        else:
            x.append(f.dims([size])[0])
            y.append(x[-1])
    return f.rule([tuple(x)], [tuple(y)], linear=_LINEAR)
