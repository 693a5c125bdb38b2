"""The tests' guard against tracing covers every module that calls ``capture_step`` and
leaves none of them patched afterwards."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from tracing_guard import READERS, forbid_capture


def test_the_guard_catches_a_trace_through_every_reader(monkeypatch):
    import importlib
    forbid_capture(monkeypatch, "traced here")
    for name in READERS:
        with pytest.raises(AssertionError, match="traced here"):
            importlib.import_module(name).capture_step(None, (), None)


def test_the_guard_leaves_nothing_patched_where_auto_was_not_imported_yet():
    """In a fresh process (here ``auto`` is imported already): ``import torchalpa`` imports
    neither ``auto`` nor ``build``, so a plan made under the guard imports them."""
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import pytest
import torchalpa
from tracing_guard import forbid_capture
assert "torchalpa.parallel.auto" not in sys.modules
patch = pytest.MonkeyPatch()
forbid_capture(patch, "traced")
from torchalpa.parallel import auto, build, workflow
patch.undo()
real = workflow.capture_step
assert real.__module__ == "torchalpa.parallel.workflow", real
assert auto.capture_step is real and build.capture_step is real, "the patch leaked"
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
