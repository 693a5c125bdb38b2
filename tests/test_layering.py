"""The architecture's layers, checked on the source: every import statement (at the top of
a module, inside a function, under ``TYPE_CHECKING``) follows the allowed arrows, and the
imports between our modules form no cycle.

The layers (``../shared/DESIGN.md``), each allowed to import only those listed:

    cli        anything, the package included
    parallel   interop, views, frontends, passes, runtime, models, ops, core
    interop    views, frontends, passes, runtime, ops, core
    views      core
    frontends  ops, core         (never passes or runtime)
    passes     ops, core         (never frontends or runtime)
    runtime    ops, core         (never frontends or passes)
    models     ops, core         (the model zoo: plain torch modules)
    ops        core
    core       nothing of ours

The package ``torchalpa/__init__.py`` (with ``__main__.py``, ``python -m torchalpa``) is the
top: it may import any layer, and nothing of ours imports it (a module names the module it
needs, never the package).
"""

import ast
import pathlib
import subprocess
import sys

import networkx as nx

ROOT = pathlib.Path(__file__).resolve().parent.parent
# setup.cfg's package_dir: folder -> installed package.
PACKAGES = {"torchalpa": "torchalpa", "frontends": "torchalpa.frontends",
            "passes": "torchalpa.passes", "runtime": "torchalpa.runtime"}
ALLOWED = {
    "cli": {"parallel", "interop", "views", "frontends", "passes", "runtime", "models", "ops",
            "core"},
    "parallel": {"interop", "views", "frontends", "passes", "runtime", "models", "ops", "core"},
    "interop": {"views", "frontends", "passes", "runtime", "ops", "core"},
    "views": {"core"},
    "frontends": {"ops", "core"},
    "passes": {"ops", "core"},
    "runtime": {"ops", "core"},
    "models": {"ops", "core"},
    "ops": {"core"},
    "core": set(),
}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts
                     if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def layer_of(module: str) -> str:
    """``torchalpa.passes.rules.matmul`` -> ``passes``; the package itself and its
    ``__main__`` (``python -m torchalpa``) -> ``top``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else "top"


def _imports(module: str, path: pathlib.Path, known):
    """(line, imported module) for every import statement anywhere in the module;
    ``from pkg import sub`` names pkg.sub when sub is a module."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
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


def _ours(target: str, known) -> str | None:
    """The module of ours ``target`` names (or is inside), or None for other packages."""
    while target and target not in known:
        target = target.rpartition(".")[0]
    return target or None


def _edges():
    modules = _modules()
    for module, path in modules.items():
        for line, target in _imports(module, path, modules):
            ours = _ours(target, modules)
            if ours is not None and ours != module:
                yield module, path, line, ours


def test_every_module_is_in_a_layer():
    unknown = sorted({layer_of(m) for m in _modules()} - set(ALLOWED) - {"top"})
    assert not unknown, f"modules outside the layers {sorted(ALLOWED)}: {unknown}"


def test_imports_follow_the_layers():
    offending = []
    for module, path, line, target in _edges():
        source, dest = layer_of(module), layer_of(target)
        if source in ("top", "cli") or source == dest:
            continue
        if dest == "top":
            offending.append(f"{path.relative_to(ROOT)}:{line} imports the torchalpa package; "
                             "import the module that defines the name")
        elif dest not in ALLOWED[source]:
            offending.append(f"{path.relative_to(ROOT)}:{line} ({source}) imports {target} "
                             f"({dest}); {source} may import {sorted(ALLOWED[source]) or 'nothing'}")
    assert not offending, "\n".join(offending)


def test_no_import_cycles_counting_every_import_statement():
    graph = nx.DiGraph()
    for module, _, _, target in _edges():
        graph.add_edge(module, target)
    cycles = [" -> ".join(c) for c in nx.simple_cycles(graph)]
    assert not cycles, "\n".join(cycles)


def test_no_module_imports_another_modules_private_names():
    modules = _modules()
    offending = []
    for _module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchalpa"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                if private:
                    offending.append(f"{path.relative_to(ROOT)}:{node.lineno} imports "
                                     f"{private} from {node.module}")
    assert not offending, "\n".join(offending)


def test_rule_families_import_the_registry_not_the_package():
    modules = _modules()
    for module, path in modules.items():
        if module.startswith("torchalpa.passes.rules."):
            targets = {t for _, t in _imports(module, path, modules)}
            assert "torchalpa.passes.rules" not in targets, (
                f"{path.relative_to(ROOT)}: import register, FactorNamer... from "
                "torchalpa.passes.rules.registry (the package __init__ imports every family)")


def test_the_layering_test_catches_an_import_against_the_arrows(tmp_path):
    """The checks above see imports written inside functions too."""
    source = tmp_path / "bad.py"
    source.write_text("def f():\n    from torchalpa.runtime.execution.mesh import rank\n")
    known = {"torchalpa.runtime.execution.mesh": source}
    assert list(_imports("torchalpa.passes.bad", source, known)) == \
        [(2, "torchalpa.runtime.execution.mesh")]
    assert "runtime" not in ALLOWED[layer_of("torchalpa.passes.bad")]


def test_planning_passes_load_no_runtime():
    # A fresh interpreter: this test process has long imported everything.
    code = ("import sys, torchalpa.passes.sharding.intra_op, "
            "torchalpa.passes.pipeline_search.inter_op\n"
            "bad = sorted(m for m in sys.modules if m.startswith(('torchalpa.runtime', "
            "'torch.distributed.checkpoint')))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_api_loads_no_runtime():
    """``import torchalpa`` and its entry points stay light: the runtime is loaded when a
    model is built, not when the API is imported."""
    code = ("import sys, torchalpa, torchalpa.parallel.api\n"
            "bad = sorted(m for m in sys.modules if m.startswith('torchalpa.runtime'))\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_ilp_loads_no_torch():
    code = "import sys, torchalpa.passes.sharding.ilp; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_lazy_public_names():
    import torchalpa
    from torchalpa.core.plan import Plan
    from torchalpa.parallel import api

    assert torchalpa.plan is api.plan and torchalpa.auto_parallel is api.auto_parallel
    assert torchalpa.Plan is Plan
    assert torchalpa.save_checkpoint.__module__ == "torchalpa.runtime.state.checkpoint"
    assert torchalpa.MixedPrecision.__module__ == "torchalpa.runtime.execution.precision"
    for name in torchalpa.__all__:
        assert getattr(torchalpa, name) is not None
