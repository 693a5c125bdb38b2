"""How a plan is shown -- text, HTML, Chrome traces, torch's tensor-parallel plan -- is
written in the layers above the core (``torchalpa.views``, ``torchalpa.interop``), which
register their functions here (``register_view``). So ``Plan.summary()`` works while the
core imports nothing of the layers that read plans.

The package (``torchalpa/__init__.py``) adds the loader of those modules
(``add_view_loader``); it runs the first time a view is asked for, so that
``import torchalpa`` (and ``torchalpa --help``) loads none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["register_view", "add_view_loader", "view"]

_VIEWS: dict[str, Callable[..., Any]] = {}
_VIEW_LOADERS: list[Callable[[], None]] = []


def register_view(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: ``fn`` renders plans as ``name`` (``summary``, ``explain``, ``html``...)."""
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _VIEWS[name] = fn
        return fn
    return register


def add_view_loader(load: Callable[[], None]) -> None:
    """``load()`` imports modules that register views; called once, when first needed."""
    _VIEW_LOADERS.append(load)


def view(name: str) -> Callable[..., Any]:
    """The function registered as ``name``, the registering modules loaded if need be."""
    while name not in _VIEWS and _VIEW_LOADERS:
        _VIEW_LOADERS.pop(0)()
    try:
        return _VIEWS[name]
    except KeyError:
        raise RuntimeError(f"no plan view {name!r} is registered: `import torchalpa` loads "
                           "them (torchalpa.views, torchalpa.interop.tp_plan)") from None
