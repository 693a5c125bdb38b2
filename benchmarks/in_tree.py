"""Run a benchmark script with ``import torchalpa`` reading another source tree, to compare
two commits' plans or timings back to back:

    git archive <commit> | tar -x -C /tmp/base
    python benchmarks/in_tree.py /tmp/base benchmarks/plan_json_ab.py 2 /tmp/before.json
    python benchmarks/plan_json_ab.py 2 /tmp/after.json

``PYTHONPATH=/tmp/base`` alone is not enough: the editable install maps
``torchalpa.passes``, ``.runtime`` and ``.frontends`` to its own checkout whatever the path
says, so the other tree's ``torchalpa`` would run this checkout's passes. ``import_tree``
puts a finder ahead of it for the four top packages (setup.cfg's ``package_dir``);
subpackages are then found under their parent's path.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import re
import runpy
import sys

PACKAGES = {"torchalpa": "torchalpa", "torchalpa.frontends": "frontends",
            "torchalpa.passes": "passes", "torchalpa.runtime": "runtime"}
"""setup.cfg's package_dir: where each top package of a source tree lies."""


def import_tree(root: str) -> None:
    """Make ``import torchalpa`` read the tree at ``root``; call it before anything
    imports torchalpa."""
    root = os.path.abspath(root)
    if not os.path.isfile(os.path.join(root, "torchalpa", "__init__.py")):
        raise SystemExit(f"{root} is not a torchalpa source tree (no torchalpa/__init__.py); "
                         f"make one with `git archive <commit> | tar -x -C {root}`")

    class Root(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name not in PACKAGES:
                return None
            where = os.path.join(root, PACKAGES[name])
            return importlib.util.spec_from_file_location(
                name, os.path.join(where, "__init__.py"), submodule_search_locations=[where])

    sys.meta_path.insert(0, Root())


def target_g_candidate(root: str, k: int):
    """Target g's first pipeline candidate, with ``import torchalpa`` reading the tree at
    ``root`` (``import_tree``, then checked): GPT-39B captured at one micro-batch of
    1024 / ``k`` on the meta device, the 8 x 8 H100 cluster and ``PipeshardParallel`` with
    ``k`` micro-batches, as (graph, cluster, method). What ``pipeline_cpu_ab.py`` plans
    and ``stage_solve_ab.py`` solves stages of."""
    import_tree(root)
    import torch

    import torchalpa
    import torchalpa.models as zoo
    from torchalpa.core.options import PipeshardParallel
    from torchalpa.frontends.torch_export import capture

    assert torchalpa.__file__.startswith(root), (torchalpa.__file__, root)
    w = zoo.gpt_39b().replace(batch_size=1024 // k)
    with torch.device("meta"):
        model, batch = w.build(), w.example_inputs()
    graph = capture(model, batch, w.loss_fn).graph
    return graph, torchalpa.Cluster.h100(num_nodes=8), PipeshardParallel(num_micro_batches=k)


def plan_text(plan, indent: int | None = None) -> str:
    """``plan``'s JSON as two trees' plans compare: notes and timing figures left out, the
    stages' own solve seconds too (they differ run to run), source paths by file name
    (each tree writes its own root), and the solver's ``time_limit`` wherever an option
    records it: a safety net that shapes no layout unless it fires (the notes say when),
    so two trees whose nets differ compare alike."""
    d = json.loads(plan.to_json())
    d.pop("notes", None)
    _drop_time_limits(d)
    est = d.get("estimates", {})
    for key in [k for k in est if "second" in k and k != "step_time_s"]:
        est.pop(key)
    import torchalpa
    root = os.path.dirname(os.path.dirname(os.path.abspath(torchalpa.__file__)))
    text = json.dumps(d, sort_keys=True, indent=indent)
    text = re.sub(r'\n? *"(ilp|solve)_seconds": [^,\n}]*,?', "", text)   # stages' own
    text = text.replace(root + "/", "").replace(root.lstrip("/") + "/", "")
    return re.sub(r'"stack": "[^"]*?([^/"]+\.py:\d+)"', r'"stack": "\1"', text)


def _drop_time_limits(value) -> None:
    """Remove every ``auto_sharding_option``'s ``time_limit`` in ``value`` (the plan's
    method and each stage's), in place."""
    if isinstance(value, dict):
        option = value.get("auto_sharding_option")
        if isinstance(option, dict):
            option.pop("time_limit", None)
        for v in value.values():
            _drop_time_limits(v)
    elif isinstance(value, list):
        for v in value:
            _drop_time_limits(v)


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: python benchmarks/in_tree.py TREE SCRIPT [ARGS...]")
    import_tree(sys.argv[1])
    script = sys.argv[2]
    sys.argv = sys.argv[2:]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
