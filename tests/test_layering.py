"""The architecture's one-way data flow, checked on the source: frontends and passes never
import the runtime, the planning passes load neither torch.distributed.checkpoint nor the
runtime, and module-level imports inside the package form no cycle."""

import ast
import pathlib
import subprocess
import sys

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent
# setup.cfg's package_dir: folder -> installed package.
PACKAGES = {"torchalpa": "torchalpa", "frontends": "torchalpa.frontends",
            "passes": "torchalpa.passes", "runtime": "torchalpa.runtime"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts
                     if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _imports(module: str, path: pathlib.Path, known, top_level_only: bool):
    """(line, imported module) for each import; `from pkg import sub` names pkg.sub."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else ast.walk(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield node.lineno, full if full in known else base


def test_frontends_and_passes_never_import_the_runtime():
    modules = _modules()
    offending = []
    for module, path in modules.items():
        if not module.startswith(("torchalpa.frontends", "torchalpa.passes")):
            continue
        for line, target in _imports(module, path, modules, top_level_only=False):
            if target.startswith(("torchalpa.runtime", "torch.distributed")):
                offending.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
            if module.startswith("torchalpa.frontends") and target.startswith("torchalpa.passes"):
                offending.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert not offending, "\n".join(offending)


def test_no_import_cycles():
    modules = _modules()
    graph = nx.DiGraph()
    for module, path in modules.items():
        for _, target in _imports(module, path, modules, top_level_only=True):
            if target in modules and target != module:
                graph.add_edge(module, target)
    cycles = [" -> ".join(c) for c in nx.simple_cycles(graph)]
    assert not cycles, "\n".join(cycles)


def test_rule_families_import_the_registry_not_the_package():
    modules = _modules()
    for module, path in modules.items():
        if module.startswith("torchalpa.passes.rules."):
            targets = {t for _, t in _imports(module, path, modules, top_level_only=False)}
            assert "torchalpa.passes.rules" not in targets, (
                f"{path.relative_to(ROOT)}: import register, FactorNamer... from "
                "torchalpa.passes.rules.registry (the package __init__ imports every family)")


def test_planning_passes_load_no_runtime():
    # A fresh interpreter: this test process has long imported everything.
    code = ("import sys, torchalpa.passes.intra_op, torchalpa.passes.inter_op\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('torchalpa.runtime', "
            "'torch.distributed.checkpoint')))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_api_loads_no_method_runtime():
    """api dispatches through the method object: importing it loads neither the pipeline's
    orchestration (``pipeshard``) nor the runtime (``shard``'s names are re-exported)."""
    code = ("import sys, torchalpa.api\n"
            "bad = sorted(m for m in sys.modules if m in ('torchalpa.pipeshard',) or "
            "m.startswith('torchalpa.runtime'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_ilp_loads_no_torch():
    code = "import sys, torchalpa.passes.ilp; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_lazy_public_names():
    import torchalpa
    from torchalpa import api, runtime  # noqa: F401
    from torchalpa.plan import Plan

    assert torchalpa.plan is api.plan and torchalpa.auto_parallel is api.auto_parallel
    assert torchalpa.Plan is Plan
    assert torchalpa.save_checkpoint.__module__ == "torchalpa.runtime.checkpoint"
    assert torchalpa.MixedPrecision.__module__ == "torchalpa.runtime.precision"
    for name in torchalpa.__all__:
        assert getattr(torchalpa, name) is not None
