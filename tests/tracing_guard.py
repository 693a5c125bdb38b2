"""Fail a test if anything traces the training step, by patching ``capture_step`` in every
module that reads it (``workflow`` defines it; ``auto`` and ``build`` bind it by name when
first imported). Patching ``workflow`` alone caught only its own callers, and where ``auto``
or ``build`` were first imported under the patch they bound the patched function and kept
it after the test: every later plan in the process then failed as "traced"."""

from __future__ import annotations

import pytest

READERS = ("torchalpa.parallel.workflow", "torchalpa.parallel.auto",
           "torchalpa.parallel.build")
"""The modules whose ``capture_step`` a plan calls (``grep -rn "capture_step(" torchalpa``)."""


def forbid_capture(monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """Raise ``AssertionError(why)`` from any call of ``capture_step`` until the test ends;
    every reader is imported before any is patched, so none binds the patched function."""
    import importlib

    def traced(*args, **kwargs):
        raise AssertionError(why)
    readers = [importlib.import_module(name) for name in READERS]   # all, before any patch
    for module in readers:
        monkeypatch.setattr(module, "capture_step", traced)
