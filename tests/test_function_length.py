"""No function anywhere in the package is longer than 80 lines, docstring included
(../shared/STYLE.md: a reader should not have to decode a function a screen and a half long). Checked on the source
with ``ast``, nested functions counted on their own and inside their parent."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
FOLDERS = ("torchalpa", "frontends", "passes", "runtime")
MAX_LINES = 80


def long_functions(folder: pathlib.Path, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (n lines)`` of every function in ``folder`` longer than ``limit``
    (paths relative to ``folder``)."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                end = node.end_lineno if node.end_lineno is not None else node.lineno
                length = end - node.lineno + 1
                if length > limit:
                    found.append(f"{path.relative_to(folder)}:{node.lineno} {node.name} "
                                 f"({length} lines)")
    return found


def test_no_function_of_the_package_is_over_80_lines():
    for folder in FOLDERS:
        assert long_functions(ROOT / folder) == []


def test_the_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path) == [f"m.py:5 long ({MAX_LINES + 1} lines)"]
