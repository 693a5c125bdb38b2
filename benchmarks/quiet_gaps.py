"""How long planning stays silent: the longest gaps between the lines a job logs, and the
time to its plan or its refusal.

    OMP_NUM_THREADS=1 TORCHALPA_CACHE=0 python benchmarks/quiet_gaps.py a
    OMP_NUM_THREADS=1 TORCHALPA_CACHE=0 python benchmarks/quiet_gaps.py nofit405 nofit70
    OMP_NUM_THREADS=1 python benchmarks/in_tree.py /tmp/base benchmarks/quiet_gaps.py pipe

Each job plans in a child process (``TORCHALPA_LOG=info``, its stderr a pipe: the plain
lines a log gets, as a person sees them when nothing configures logging) with the default
method unless said. This process stamps each line as it arrives and prints, per job, the
seconds to the answer, the line count, and every gap over ``--gap`` seconds (default 10)
with the line before it (what was running); the gap before the first line (importing
torch and torchalpa, building the model: the user's script) and after the last (the
process's exit) are listed apart. ``--keep DIR`` writes each job's stamped lines there.

Jobs (meta weights, AdamW):
  a         LLaMA-3-8B bf16, batch 16 x 8192, 1 x 8 H100 (target a)
  pipe      LLaMA-3-70B cut to 2 blocks, bf16, 2 x 8 H100, AutoParallel(16 micro-batches,
            remat none): one pipeline candidate (the search's layer ILPs, stage DP, stages)
  nofit405  LLaMA-3.1-405B bf16 on 1 x 8 H100
  nofit70   LLaMA-3-70B (float32) on 2 devices of 16 GB
  nofit39   GPT-39B (float32) on 1 x 2 A100-40GB
  nofit8    LLaMA-3-8B (float32), batch 16 x 8192, on 1 L4 (24 GB)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

GB = 1024 ** 3


def _job(name: str):
    """(model, batch, loss_fn), cluster, plan keywords of job ``name``."""
    import torch

    import torchalpa
    import torchalpa.models as zoo
    from torchalpa.core.options import AutoParallel

    def meta(workload):
        with torch.device("meta"):
            model = workload.build()
        return model, workload.example_inputs(device="meta"), workload.loss_fn

    bf16 = {"mixed_precision": torchalpa.MixedPrecision(param_dtype=torch.bfloat16)}
    jobs = {
        "a": lambda: (meta(zoo.llama3_8b()), torchalpa.Cluster.h100(1, 8), bf16),
        "pipe": lambda: (meta(zoo.llama3_70b().replace(num_layers=2)),
                         torchalpa.Cluster.h100(num_nodes=2),
                         {**bf16, "method": AutoParallel(num_micro_batches=16, remat="none")}),
        "nofit405": lambda: (meta(zoo.llama3_405b()), torchalpa.Cluster.h100(1, 8), bf16),
        "nofit70": lambda: (meta(zoo.llama3_70b()), torchalpa.Cluster(
            num_nodes=1, devices_per_node=2, memory_per_device=16 * GB), {}),
        "nofit39": lambda: (meta(zoo.gpt_39b()), torchalpa.Cluster.a100(1, 2), {}),
        "nofit8": lambda: (meta(zoo.llama3_8b()), torchalpa.Cluster.preset("l4", 1, 1), {}),
    }
    return jobs[name]()


def child(name: str) -> None:
    """Plan job ``name``; print how it ended and the seconds ``torchalpa.plan`` took."""
    import torchalpa
    (model, batch, loss_fn), cluster, options = _job(name)
    try:                          # the floor alone, where the tree has one
        from torchalpa.core.options import AutoParallel
        from torchalpa.parallel.states_floor import states_refusal
        from torchalpa.parallel.workflow import with_precision
        start = time.perf_counter()
        refused = states_refusal(with_precision(model, options.get("mixed_precision")),
                                 options.get("method") or AutoParallel(), cluster)
        print(f"FLOOR {'refuses' if refused else 'passes'} in "
              f"{time.perf_counter() - start:.3f} s", flush=True)
    except ImportError:
        pass
    start = time.perf_counter()
    try:
        plan = torchalpa.plan(model, batch, loss_fn, cluster=cluster, **options)
        print(f"ANSWER plan in {time.perf_counter() - start:.1f} s: est "
              f"{plan.estimates.step_time_s:.4g} s/step, {plan.method.get('name')}, "
              f"offload {plan.method.get('offload')}", flush=True)
    except ValueError as e:
        print(f"ANSWER refused in {time.perf_counter() - start:.1f} s: {type(e).__name__}: "
              f"{str(e).splitlines()[0][:120]}...\n{e}", flush=True)


def watch(name: str, gap: float, keep: str | None) -> None:
    """Run job ``name`` in a child, stamping its lines; print its gaps."""
    env = {**os.environ, "TORCHALPA_LOG": "info", "PYTHONUNBUFFERED": "1"}
    env.setdefault("TORCHALPA_CACHE", "0")
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-u", *_interpreter_args(), "--child", name],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert proc.stdout is not None
    stamped, gaps, last, before, answer = [], [], start, "(start)", ""
    first = None
    for raw in proc.stdout:
        now = time.time()
        line = raw.decode(errors="replace").rstrip("\n")
        if first is None:
            first = now - start
        elif now - last > gap:
            gaps.append((now - start, now - last, before))
        if line.startswith("ANSWER"):
            answer = line.removeprefix("ANSWER ")
        stamped.append(f"{now - start:8.1f} +{now - last:6.1f} {line}")
        last, before = now, line
    proc.wait()
    end = time.time()
    load = os.getloadavg()[0]
    print(f"{name}: {answer or f'no answer (exit {proc.returncode})'}; {len(stamped)} lines "
          f"in {end - start:.1f} s (load {load:.1f}); before the first line {first or 0:.1f} s, "
          f"after the last {end - last:.1f} s; {len(gaps)} gaps over {gap:g} s between lines",
          flush=True)
    for at, seconds, after in gaps:
        print(f"    {seconds:6.1f} s ending at {at:7.1f} s, after: {after[:150]}", flush=True)
    if keep:
        os.makedirs(keep, exist_ok=True)
        with open(os.path.join(keep, f"{name}.log"), "w") as f:
            f.write("\n".join(stamped) + "\n")


def _interpreter_args() -> list[str]:
    """This script again, through ``in_tree.py`` when that is how it was started (so the
    child plans with the same source tree)."""
    tree = os.environ.get("QUIET_GAPS_TREE")
    here = os.path.abspath(__file__)
    if tree:
        return [os.path.join(os.path.dirname(here), "in_tree.py"), tree, here]
    return [here]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("jobs", nargs="*", default=["a"])
    p.add_argument("--gap", type=float, default=10.0)
    p.add_argument("--keep", default=None, help="a folder for each job's stamped lines")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child)
        return
    import torchalpa  # another tree's where started through in_tree.py: keep it
    tree = os.path.dirname(os.path.dirname(os.path.abspath(torchalpa.__file__)))
    if tree != os.path.dirname(os.path.dirname(os.path.abspath(__file__))):
        os.environ["QUIET_GAPS_TREE"] = tree
    for name in args.jobs:
        watch(name, args.gap, args.keep)


if __name__ == "__main__":
    main()
