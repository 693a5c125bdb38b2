"""Run a benchmark script with some ``AutoShardingOption`` defaults changed, to compare a
planner option on and off on a script that builds its own methods (``auto_targets.py``,
``stage_phase_probe.py``) without editing it:

    python benchmarks/option_default.py free_followers_near_budget=0 \\
        benchmarks/auto_targets.py --targets g

Every ``AutoShardingOption`` built after this (the search's own, ``replace`` copies, the
script's) takes the new default unless a caller passes the field; the planner's forked
workers inherit it. Values are read as Python literals (``0``, ``0.95``, ``None``).
"""

from __future__ import annotations

import ast
import os
import runpy
import sys

from torchalpa.core.options import AutoShardingOption


def set_defaults(assignments: list[str]) -> None:
    """Set each ``name=value`` as the default of ``AutoShardingOption``'s field ``name``."""
    defaults = AutoShardingOption.__init__.__kwdefaults__
    assert defaults is not None, "AutoShardingOption's fields are keyword-only"
    for assignment in assignments:
        name, _, text = assignment.partition("=")
        if name not in defaults:
            raise SystemExit(f"AutoShardingOption has no field with a plain default {name!r}")
        defaults[name] = ast.literal_eval(text)


def main() -> None:
    split = next((i for i, a in enumerate(sys.argv[1:], 1) if "=" not in a), None)
    if split is None:
        raise SystemExit(__doc__)
    set_defaults(sys.argv[1:split])
    sys.argv = sys.argv[split:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
