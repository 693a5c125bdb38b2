"""Every sub-package says what it is for one floor down too: its ``__init__`` docstring lists
each of its modules and sub-packages on a line of its own (``- ``name``: its role``), so a
reader opening a folder finds the map there, and a module added without a line in it is
caught here, not months later. benchmarks/README.md does the same for the scripts there."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("torchalpa", "frontends", "passes", "runtime")


def packages() -> list[pathlib.Path]:
    """Every package folder of the four top packages."""
    return [init.parent for folder in FOLDERS
            for init in sorted((ROOT / folder).rglob("__init__.py"))]


def _parts(package: pathlib.Path) -> list[str]:
    """The modules of ``package`` (not ``__init__`` nor ``__main__``) and its sub-packages;
    the top package lists the folders installed beneath it (setup.cfg's ``package_dir``)."""
    names = [p.stem for p in sorted(package.glob("*.py")) if not p.stem.startswith("__")]
    names += [p.name for p in sorted(package.iterdir())
              if p.is_dir() and (p / "__init__.py").is_file()]
    if package == ROOT / "torchalpa":
        names += [folder for folder in FOLDERS if folder != "torchalpa"]
    return names


def unlisted(package: pathlib.Path) -> list[str]:
    """The modules and sub-packages of ``package`` its ``__init__`` docstring does not name
    as ````name```` on a list line (one beginning ``- ``)."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    listed = {name for line in doc.splitlines() if line.lstrip().startswith("- ")
              for name in re.findall(r"``(\w+)``", line)}
    return [name for name in _parts(package) if name not in listed]


def test_every_package_docstring_lists_its_modules():
    missing = {str(p.relative_to(ROOT)): unlisted(p) for p in packages()}
    missing = {k: v for k, v in missing.items() if v}
    assert not missing, (
        f"modules or sub-packages not listed in their package's __init__ docstring: "
        f"{missing}; add a line ``- ``name``: what it is for`` to that docstring")


def listed_scripts(readme: str) -> set[str]:
    """The scripts a benchmarks README lists: ```name.py``` (or ``.sh``) opening a list line."""
    return set(re.findall(r"^- `([\w.]+\.(?:py|sh))`", readme, re.M))


def test_the_benchmarks_readme_lists_every_script_and_no_other():
    folder = ROOT / "benchmarks"
    scripts = {p.name for p in folder.iterdir() if p.suffix in (".py", ".sh")}
    listed = listed_scripts((folder / "README.md").read_text())
    assert scripts - listed == set(), f"benchmarks/README.md does not list {scripts - listed}"
    assert listed - scripts == set(), f"benchmarks/README.md lists {listed - scripts}, gone"


def test_the_check_sees_a_missing_module(tmp_path):
    (tmp_path / "__init__.py").write_text(
        '"""A package.\n\n- ``kept``: here.\n\nSee ``mentioned`` too."""\n')
    for name in ("kept", "forgotten", "mentioned"):
        (tmp_path / f"{name}.py").write_text("")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "__init__.py").write_text("")
    assert unlisted(tmp_path) == ["forgotten", "mentioned", "sub"]
    assert listed_scripts("- `kept.py`: here.\n  `python benchmarks/kept.py`\n"
                          "See `other.py`.\n- `run.sh`: a shell.\n") == {"kept.py", "run.sh"}
