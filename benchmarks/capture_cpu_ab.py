"""What the search's capture costs, before and after a change, alternately in one run.

Target a's capture work (``auto_targets.py``: LLaMA-3-8B bf16, batch 16 x 8192, meta, on
1 x 8 H100): the whole batch traced (the trace itself, then what torchalpa does with it:
functionalizing, the OpGraph, its code), 2 micro-batches (``--first``) derived and checked
(the search's check of the micro-batch derivation: a tree with ``rebatch_check`` records
the step's ops at both counts, and traces only where they cannot vouch; an older tree
traces that count and compares), 4 micro-batches (8 where ``--first`` is 4) derived, and
four checkpointing / parameters-gathered-again variants derived, as the search derives
them. Each side runs in a child process, alternately (before, after, before, ...), and
reports its own CPU seconds (``time.process_time``) per stage; the ratios are after /
before of the means. Every capture of both sides is hashed (OpGraph nodes, outputs, meta,
generated code): the run fails (exit 1) unless the two sides made the same captures.

    git archive <commit> | tar -x -C /tmp/base
    OMP_NUM_THREADS=1 python benchmarks/capture_cpu_ab.py /tmp/base [--layers 32] [--rounds 2] \
        [--model llama3_70b] [--first 128]

``--model``: another LLaMA of the zoo (``llama3_70b``: target e's model, its batch 128 x 8192);
the two traces are also shown per layer (CPU s / ``--layers``).

``/tmp/base`` is imported in place of this tree (its ``torchalpa`` package with
``frontends``, ``passes`` and ``runtime`` linked in, as ``setup.cfg`` maps them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAGES = ["trace", "after the trace", "check: trace", "check: the rest",
          "micro-batch derivation", "variants", "total"]


def child(layers: int, model_name: str = "llama3_8b", first: int = 2) -> dict:
    """Run in the child: every stage's CPU seconds and the captures' hash."""
    import hashlib
    import time

    import torch

    import torchalpa
    import torchalpa.frontends.rebatch as rebatch
    import torchalpa.frontends.torch_export as te
    import torchalpa.models as zoo
    from torchalpa.parallel.auto import derived_capture
    from torchalpa.parallel.workflow import capture_examples, capture_step, with_precision

    spent = dict.fromkeys(STAGES, 0.0)
    inner = {"trace": 0.0}
    trace_joint = te._trace_joint

    def timed_trace(*args, **kwargs):
        start = time.process_time()
        try:
            return trace_joint(*args, **kwargs)
        finally:
            inner["trace"] += time.process_time() - start
    te._trace_joint = timed_trace
    w = zoo.NAMED[model_name]().replace(num_layers=layers)
    with torch.device("meta"):
        model = with_precision(w.build(), torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
    batch = w.example_inputs(device="meta")
    try:     # a tree with records checking the derivation (r11-derive) uses them, as the search
        from torchalpa.frontends.rebatch_check import RecordCheck
        from torchalpa.frontends.torch_export import record_step
        check = RecordCheck(
            lambda k: record_step(model, capture_examples(model, batch, k), w.loss_fn))
    except ImportError:
        check = None
    steps = rebatch.MicroBatchSteps(
        lambda k: capture_step(model, capture_examples(model, batch, k), w.loss_fn),
        *([check] if check else []))
    digest = hashlib.sha256()

    def kept(captured):
        g = captured.graph
        for n in g:
            digest.update(repr(n).encode())
        digest.update(repr((g.outputs, sorted(g.meta.items()), captured.gm.code)).encode())

    def stage(name, fn):
        before, start = inner["trace"], time.process_time()
        out = fn()
        cpu, traced = time.process_time() - start, inner["trace"] - before
        if name == "whole":
            spent["trace"] += traced
            spent["after the trace"] += cpu - traced
        elif name == "check":
            spent["check: trace"] += traced
            spent["check: the rest"] += cpu - traced
        else:
            spent[name] += cpu
        spent["total"] += cpu
        return out

    second = 4 if first != 4 else 8
    stage("whole", lambda: steps(1))
    stage("check", lambda: steps(first))
    stage("micro-batch derivation", lambda: steps(second))
    variants = [(1, "full", False), (2, "full:4", False), (2, "full:4", True), (4, "none", True)]
    made = stage("variants", lambda: [derived_capture(steps(k), r, g) for k, r, g in variants])
    for captured in [steps(1), steps(first), steps(second), *made]:
        kept(captured)
    return {"seconds": spent, "hash": digest.hexdigest()[:16], "checked": steps.checked,
            "derived": sorted(steps.derived), "nodes": len(steps(1).graph),
            "vouched": getattr(steps, "vouched", False)}


def _linked_tree(base: str, into: str) -> str:
    """A directory holding ``base``'s torchalpa package with its mapped sub-packages."""
    root = os.path.join(into, "tree")
    os.makedirs(os.path.join(root, "torchalpa"))
    for name in os.listdir(os.path.join(base, "torchalpa")):
        os.symlink(os.path.join(base, "torchalpa", name), os.path.join(root, "torchalpa", name))
    for name in ("frontends", "passes", "runtime"):
        os.symlink(os.path.join(base, name), os.path.join(root, "torchalpa", name))
    return root


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base", nargs="?", help="the tree before (a git archive)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="llama3_8b", choices=("llama3_8b", "llama3_70b"))
    p.add_argument("--first", type=int, default=2,
                   help="the micro-batch count checked (target e's search: 128)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.layers, args.model, args.first)))
        return 0
    if not args.base:
        p.error("give the tree before (a git archive of the commit to compare with)")
    with tempfile.TemporaryDirectory() as tmp:
        sides = {"before": _linked_tree(os.path.abspath(args.base), tmp), "after": None}
        cwd = os.path.join(tmp, "run")      # neither tree below it: nodes' lines name
        os.makedirs(cwd)                      # files alike (provenance.short_path)
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        print(f"{args.model} bf16, {args.layers} layers, batch "
              f"{'128' if args.model == 'llama3_70b' else '16'} x 8192; "
              f"load {os.getloadavg()[0]:.1f}")
        for r in range(args.rounds):
            for side, tree in sides.items():
                env = dict(os.environ, OMP_NUM_THREADS="1", TORCHALPA_CACHE="0")
                if tree:
                    env["PYTHONPATH"] = tree
                # the script from this tree, run as a file: the child imports torchalpa
                # from PYTHONPATH (the tree before) or the installed one (this tree)
                out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                      "--layers", str(args.layers), "--model", args.model,
                                      "--first", str(args.first)],
                                     env=env, cwd=cwd,
                                     capture_output=True, text=True, check=True)
                got = json.loads(out.stdout.strip().splitlines()[-1])
                runs[side].append(got)
                print(f"  round {r + 1} {side:6s}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in got["seconds"].items())
                    + f" (CPU s; hash {got['hash']}, checked {got['checked']}, derived "
                    f"{got['derived']}, vouched {got.get('vouched')}, load {os.getloadavg()[0]:.1f})")
    print(f"{'stage':28s} {'before s':>9s} {'after s':>9s} {'after/before':>13s}")
    for stage in STAGES:
        b = sum(x["seconds"][stage] for x in runs["before"]) / args.rounds
        a = sum(x["seconds"][stage] for x in runs["after"]) / args.rounds
        print(f"{stage:28s} {b:9.2f} {a:9.2f} {a / b if b else float('nan'):13.2f}")
    for stage in ("trace", "check: trace"):
        b, a = (sum(x["seconds"][stage] for x in runs[side]) / args.rounds / args.layers
                for side in ("before", "after"))
        print(f"{stage + ' per layer':28s} {b:9.3f} {a:9.3f} {a / b if b else float('nan'):13.2f}")
    hashes = {x["hash"] for side in runs.values() for x in side}
    print(f"the same captures on both sides: {len(hashes) == 1}")
    return 0 if len(hashes) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
