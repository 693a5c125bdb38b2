"""``torchalpa export`` from the command line: a torch training step written as StableHLO,
plain and annotated with a plan in Shardy (``--plan``, ``--sharding sdy``), read back by
the StableHLO frontend. (The GSPMD spelling is checked on ``export_stablehlo`` itself in
``tests/test_stablehlo.py``; here the command line's plumbing.)

The plan is the one ``torchalpa plan --stablehlo`` makes of the plain export, so the
annotated file also carries sharding constraints at the plan's resharding points. One
module-scoped fixture runs the exports (torch.export + torch-mlir, a few seconds each).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("jax", reason="jax/jaxlib are not installed: pip install 'torchalpa[stablehlo]'")
pytest.importorskip("torch_mlir", reason="torch-mlir is not installed: "
                                         "pip install 'torchalpa[stablehlo]'")

from torchalpa.cli.commands import main  # noqa: E402
from torchalpa.core.plan import load_plan  # noqa: E402
from torchalpa.frontends.stablehlo import from_stablehlo, parse_module  # noqa: E402
from torchalpa.interop.hlo_annotate import annotate_stablehlo, sdy_sharding  # noqa: E402


class TwoLayers(torch.nn.Module):
    """A two-layer MLP whose hidden layer is wide enough to be worth splitting."""

    def __init__(self, dim: int = 32, hidden: int = 256):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x):                          # (B, dim) -> (B, dim)
        return self.down(torch.tanh(self.up(x)))


def tiny_step():
    """The ``module:callable`` the command line loads: (model, example_inputs, loss_fn)."""
    torch.manual_seed(0)
    return TwoLayers(), (torch.randn(64, 32), torch.randn(64, 32)), F.mse_loss


def _arguments(text: str) -> list[dict[str, str]]:
    """Each ``@main`` argument's attributes, as strings (``torchalpa.name``, shardings)."""
    module, context = parse_module(text)
    with context:
        main_fn = next(op.operation for op in module.body.operations    # pyright: ignore
                       if op.operation.name == "func.func"
                       and str(op.operation.attributes["sym_name"]).strip('"') == "main")
        attrs = main_fn.attributes["arg_attrs"]
        out = []
        for i in range(len(attrs)):                                      # pyright: ignore
            entry = attrs[i]                                             # pyright: ignore
            out.append({a.name: str(a.attr).strip('"') for a in entry})  # pyright: ignore
        return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The texts of the plain and the Shardy-annotated export, and the plan (from JSON)."""
    root = tmp_path_factory.mktemp("export")
    model = "test_export_cli:tiny_step"
    paths = {k: root / f"{k}.mlir" for k in ("plain", "sdy")}
    assert main(["export", "--model", model, "--out", str(paths["plain"])]) == 0
    plan_path = root / "plan.json"
    assert main(["plan", "--stablehlo", str(paths["plain"]), "--mesh", "4",
                 "--preset", "local_cpu", "--json", str(plan_path)]) == 0
    assert main(["export", "--model", model, "--out", str(paths["sdy"]),
                 "--plan", str(plan_path), "--sharding", "sdy"]) == 0
    return {k: p.read_text() for k, p in paths.items()}, load_plan(str(plan_path))


def test_plain_export_reads_back_as_the_models_step(exported):
    texts, _ = exported
    graph = from_stablehlo(texts["plain"])
    assert sorted(graph.params) == ["down.bias", "down.weight", "up.bias", "up.weight"]
    assert [name for name, _ in graph.outputs.grads] == list(graph.params)
    assert "sharding" not in texts["plain"]
    names = [a.get("torchalpa.name") for a in _arguments(texts["plain"])]
    assert names[:4] == ["up.weight", "up.bias", "down.weight", "down.bias"]


def test_sdy_export_names_the_plans_placements(exported):
    """Every parameter and input argument carries the Shardy sharding of its placement in
    the plan, under a mesh of the plan's axes; the plan's resharding points become
    sharding constraints; the text still reads back as the same step."""
    texts, plan = exported
    assert any(str(p) != "Replicate()" for q in plan.parameters + plan.inputs
               for p in q.placements), "the plan splits nothing: nothing to check"
    placed = {p.name: p for p in plan.parameters + plan.inputs}
    seen = set()
    for attrs in _arguments(texts["sdy"]):
        name = attrs["torchalpa.name"]
        if name not in placed:
            continue
        p = placed[name]
        expected = sdy_sharding(p.placements, len(p.shape), plan.axis_names)
        assert attrs["sdy.sharding"] == expected, (name, attrs["sdy.sharding"], expected)
        seen.add(name)
    assert seen == set(placed)
    axes = ", ".join(f'"{a}"={n}' for a, n in zip(plan.axis_names, plan.mesh_shape))
    assert f"sdy.mesh @mesh = <[{axes}]>" in texts["sdy"]
    again = annotate_stablehlo(texts["plain"], plan, dialect="sdy")   # what it should hold
    assert texts["sdy"].count("sdy.sharding_constraint") == len(again.constraints)
    between_ops = [r for r in plan.reshards if isinstance(r.slot, int)
                   and any(s.is_collective for s in r.steps)]
    assert len(again.constraints) + sum(again.skipped.values()) == len(between_ops)
    graph = from_stablehlo(texts["sdy"])
    assert sorted(graph.params) == sorted(p.name for p in plan.parameters)


def test_export_refuses_a_plan_it_cannot_read(tmp_path, capsys):
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps({"version": 1}))
    code = main(["export", "--model", "test_export_cli:tiny_step",
                 "--out", str(tmp_path / "x.mlir"), "--plan", str(bad)])
    assert code == 2
    assert "plan" in capsys.readouterr().err
