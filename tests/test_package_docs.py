"""Every sub-package says what it is for one floor down too: its ``__init__`` docstring names
each of its modules (as ``name``, with its role), so a reader opening a folder finds the
map there, and a module added without a line in it is caught here, not months later."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("torchalpa", "frontends", "passes", "runtime")


def packages() -> list[pathlib.Path]:
    """Every package folder that holds modules of its own (not only sub-packages)."""
    found = []
    for folder in FOLDERS:
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            if any(not p.stem.startswith("__") for p in init.parent.glob("*.py")):
                found.append(init.parent)
    return found


def unnamed_modules(package: pathlib.Path) -> list[str]:
    """The modules of ``package`` its ``__init__`` docstring does not name as ``module``."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return [p.stem for p in sorted(package.glob("*.py"))   # not __init__ nor __main__
            if not p.stem.startswith("__") and f"``{p.stem}``" not in doc]


def test_every_package_docstring_names_its_modules():
    missing = {str(p.relative_to(ROOT)): unnamed_modules(p) for p in packages()}
    missing = {k: v for k, v in missing.items() if v}
    assert not missing, (
        f"modules not named in their package's __init__ docstring: {missing}; add a line "
        "``module``: what it is for, to that docstring")


def test_the_check_sees_a_missing_module(tmp_path):
    (tmp_path / "__init__.py").write_text('"""A package.\n\n- ``kept``: here."""\n')
    (tmp_path / "kept.py").write_text("")
    (tmp_path / "forgotten.py").write_text("")
    assert unnamed_modules(tmp_path) == ["forgotten"]
