"""Source locations through StableHLO: ``export_stablehlo`` writes each forward op's module
path and line of the model's code (``torchalpa/interop/stablehlo_locations.py``), and the StableHLO
frontend reads them back, so ops without a rule are named by where the user wrote them."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("jax", reason="jax/jaxlib are not installed: pip install 'torchalpa[stablehlo]'")
pytest.importorskip("torch_mlir", reason="torch-mlir is not installed: "
                                         "pip install 'torchalpa[stablehlo]'")

import torchalpa  # noqa: E402
from torchalpa.core.cluster import Cluster  # noqa: E402
from torchalpa.frontends.stablehlo import from_stablehlo  # noqa: E402


class Mirror(torch.nn.Module):
    """Reverses the features: ``stablehlo.reverse``, which has no sharding rule."""

    def forward(self, x):
        return torch.flip(x, dims=(1,))            # the line the plan should name


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.mirror = Mirror()

    def forward(self, x):
        return self.mirror(torch.tanh(self.proj(x)))


FLIP_LINE = f"{__file__}:{inspect.getsourcelines(Mirror.forward)[1] + 1}"


@pytest.fixture(scope="module")
def text():
    torch.manual_seed(0)
    return torchalpa.export_stablehlo(Net(), (torch.randn(8, 16), torch.randn(8, 16)),
                                      F.mse_loss)


def test_forward_ops_carry_their_module_and_line(text):
    graph = from_stablehlo(text)
    forward = [n for n in graph.ops() if n.phase == "forward"]
    products = [n for n in forward if n.op == "aten.mm.default"]
    assert products and all(n.module == "proj" for n in products)
    assert all(n.stack.startswith(__file__ + ":") for n in products), products[0].stack
    flip = [n for n in forward if n.op == "stablehlo.reverse"]
    assert [(n.module, n.stack) for n in flip] == [("mirror", FLIP_LINE)]
    assert f"in module 'mirror' at {FLIP_LINE}" in flip[0].where()
    # backward ops are not given the line of the forward op before them
    assert all(not n.stack for n in graph.ops() if n.phase == "backward")


def test_plan_names_the_module_of_an_op_without_a_rule(text):
    mesh = Cluster.local_cpu(2).logical_mesh((2,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = torchalpa.plan(text, (), cluster=mesh, method=torchalpa.ShardParallel())
    forward = [u for u in plan.unsupported_ops if u["module"]]
    assert {(u["op"], u["module"]) for u in forward} == {("stablehlo.reverse", "mirror")}
    assert "stablehlo.reverse" in plan.summary() and "module mirror" in plan.summary()
    assert f"module mirror  at {FLIP_LINE}" in plan.summary()
    assert any("module 'mirror'" in str(w.message) for w in caught)
