"""``frontends/einsum_products.py``: a two-operand einsum with several batch dims, written as
one ``torchalpa::batched_matmul``, computes what ``torch.einsum`` computes (values and
gradients), and every other einsum is left to torch."""

import pytest
import torch

from torchalpa.frontends.einsum_products import einsum_as_batched_matmul, parse_batched_product
from torchalpa.frontends.opset import routed_matmul
from torchalpa.frontends.torch_export import capture
from torchalpa.ops.batched_matmul import BATCHED_MATMUL_OP

PRODUCTS = [   # (equation, a's shape, b's shape)
    ("bqhd,bkhd->bhqk", (2, 5, 3, 4), (2, 6, 3, 4)),      # Flax's attention scores
    ("bhqk,bkhd->bqhd", (2, 3, 5, 6), (2, 6, 3, 4)),      # Flax's attention context
    ("bhqd,bhkd->bhqk", (2, 3, 5, 4), (2, 3, 6, 4)),      # already in matmul order
    ("xbyi,byij->bxyj", (3, 2, 4, 5), (2, 4, 5, 6)),      # free letter ahead of the batch
    ("bhqcd,bhkcd->bhkq", (2, 3, 5, 2, 4), (2, 3, 6, 2, 4)),   # two contracted letters
]


@pytest.mark.parametrize("equation,sa,sb", PRODUCTS, ids=[p[0] for p in PRODUCTS])
def test_product_matches_torch_einsum(equation, sa, sb):
    torch.manual_seed(0)
    a = torch.randn(sa, dtype=torch.float64, requires_grad=True)
    b = torch.randn(sb, dtype=torch.float64, requires_grad=True)
    product = parse_batched_product(equation, a, b)
    assert product is not None
    got = einsum_as_batched_matmul(product, a, b)
    want = torch.einsum(equation, a, b)
    assert got is not None and torch.allclose(got, want)
    g = torch.randn_like(want)
    got_grads = torch.autograd.grad(got, (a, b), g)
    want_grads = torch.autograd.grad(want, (a, b), g)
    for x, y in zip(got_grads, want_grads):
        assert torch.allclose(x, y)


LEFT_TO_TORCH = [
    ("bqd,bkd->bqk", (2, 5, 4), (2, 6, 4)),               # one batch dim: bmm as it is
    ("bhqd,bhkd", (2, 3, 5, 4), (2, 3, 6, 4)),            # implicit output
    ("...qd,...kd->...qk", (2, 3, 5, 4), (2, 3, 6, 4)),   # ellipsis
    ("bhqd,bhkd->bhq", (2, 3, 5, 4), (2, 3, 6, 4)),       # k summed inside one operand
    ("bhqd,bhkd->bhqk", (2, 1, 5, 4), (2, 3, 6, 4)),      # broadcast heads
    ("gse,gse->gs", (2, 3, 4), (2, 3, 4)),                # no free letter: a dot per row
    ("bhii,bhij->bhj", (2, 3, 4, 4), (2, 3, 4, 5)),       # a diagonal
]


@pytest.mark.parametrize("equation,sa,sb", LEFT_TO_TORCH, ids=[p[0] for p in LEFT_TO_TORCH])
def test_other_einsums_are_torch_own(equation, sa, sb):
    a, b = torch.randn(sa), torch.randn(sb)
    assert parse_batched_product(equation, a, b) is None
    with routed_matmul():
        got = torch.einsum(equation, a, b)
    assert torch.allclose(got, torch.einsum(equation, a, b))


class _Scores(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4))

    def forward(self, x):                                   # x: (B, S, heads, hd)
        return torch.einsum("bqhd,bkhd->bhqk", x * self.w, x).sum()


def test_capture_records_the_batched_product():
    """The capture routes the einsum, and ``torch.einsum`` is torch's again afterwards."""
    original = torch.einsum
    graph = capture(_Scores(), (torch.randn(2, 5, 3, 4),)).graph
    ops = [n.op for n in graph]
    assert BATCHED_MATMUL_OP in ops and "aten.bmm.default" not in ops
    assert torch.einsum is original
