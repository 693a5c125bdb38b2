"""Sweep transformers' architectures through torchalpa: build, capture, plan for 4 devices.

``torchalpa.suite.cases`` covers a few dozen HuggingFace models by hand; this script tries
every architecture transformers registers for causal LM, masked LM, sequence
classification and image classification (``transformers.models.auto.modeling_auto``),
each with its default config (``AutoConfig.for_model``) shrunk in size by a generic
shrinker (``torchalpa/suite/hf_shrink.py``: layers, widths, heads, vocab, experts, images), random weights
on the CPU, and the batch the suite would give it (``input_ids`` / ``attention_mask`` /
``labels`` for text, ``pixel_values`` / ``labels`` for images). Each architecture runs in a
worker process with a time limit, so a slow or stuck one costs at most that long; a worker
that timed out or died is replaced.

Per architecture it records how far it got (``built``, ``captured``, ``planned``), the ops
of the captured step without a sharding rule, the first line of the error and the time,
prints a table and writes JSON (after every architecture, so a partial sweep is kept;
``--resume`` skips those already in the file).

    .venv/bin/python benchmarks/hf_sweep.py --out hf_sweep.json            # everything
    .venv/bin/python benchmarks/hf_sweep.py --task causal --only llama,gpt2
    .venv/bin/python benchmarks/hf_sweep.py --report hf_sweep.json         # table only
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

TASKS = {   # task -> the mapping of transformers.models.auto.modeling_auto it sweeps
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seqcls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "imgcls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
STAGES = ("built", "captured", "planned")


def architectures(tasks) -> list[tuple[str, str, str]]:
    """(task, model_type, class name) for every architecture the tasks' mappings list."""
    from transformers.models.auto import modeling_auto
    out = []
    for task in tasks:
        for model_type, cls in getattr(modeling_auto, TASKS[task]).items():
            out.append((task, model_type, cls if isinstance(cls, str) else cls[0]))
    return out


# -- the worker: one architecture at a time ------------------------------------------------

def _try_one(task: str, model_type: str, cls_name: str, exact_below: int, report) -> dict:
    """Build, capture and plan one architecture; ``report(stage)`` as each stage ends.

    ``exact_below`` is the planner's ``AutoShardingOption.exact_below``: the sweep asks
    whether a plan exists, not for the best one, so by default (0) it skips the second,
    unsimplified ILP solve, which is most of the planning time of mid-sized graphs."""
    import torch

    import torchalpa
    from torchalpa.frontends.torch_export import capture
    from torchalpa.passes.rules import rule_for
    from torchalpa.suite.hf_shrink import build_model, example_batch

    rec: dict = {}
    start = time.perf_counter()
    torch.manual_seed(0)
    model = build_model(task, model_type, cls_name)
    batch = example_batch(task, model)
    rec["params"] = sum(p.numel() for p in model.parameters())
    rec["build_s"] = round(time.perf_counter() - start, 2)
    report("built", rec)

    try:
        start = time.perf_counter()
        graph = capture(model, batch).graph
        ops = [n.op for n in graph.ops()]
        rec["nodes"] = len(ops)
        rec["no_rule"] = sorted({n.op for n in graph.ops() if rule_for(n, graph) is None})
        rec["capture_s"] = round(time.perf_counter() - start, 2)
        report("captured", rec)

        start = time.perf_counter()
        method = torchalpa.ShardParallel(
            auto_sharding_option=torchalpa.AutoShardingOption(exact_below=exact_below))
        torchalpa.plan(model, batch, method=method, cluster=torchalpa.Cluster.local_cpu(4))
        rec["plan_s"] = round(time.perf_counter() - start, 2)
        report("planned", rec)
    except Exception:
        report("eager", {**rec, "eager": _eager(model, batch)})
        raise
    return rec


def _eager(model, batch) -> str:
    """'ok' if one device runs the step eagerly (forward, loss, backward), else the error:
    tells a torchalpa failure from a model or batch the model itself rejects."""
    try:
        out = model(**batch)
        loss = out["loss"] if isinstance(out, dict) else out[0]
        loss.backward()
        return "ok"
    except Exception as e:  # noqa: BLE001 -- reported, not handled
        return f"{type(e).__name__}: {_first_line(e)}"


def _worker(conn) -> None:
    os.environ.setdefault("TORCHALPA_LOG", "warning")
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    torch.set_num_threads(1)
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            _try_one(*job, report=lambda stage, rec: conn.send(("stage", stage, dict(rec))))
            conn.send(("done", None, None))
        except BaseException as e:  # noqa: BLE001 -- every failure is a result here
            conn.send(("error", f"{type(e).__name__}: {_first_line(e)}",
                       traceback.format_exc()[-3000:]))


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else "")[:300]


class Runner:
    """A worker process that runs one architecture at a time, replaced after a timeout."""

    def __init__(self):
        self.ctx = mp.get_context("spawn")
        self.proc = None

    def _start(self):
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child,), daemon=True)
        self.proc.start()

    def stop(self):
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.proc = None

    def run(self, job, timeout: float) -> dict:
        if self.proc is None or not self.proc.is_alive():
            self._start()
        task, model_type, cls_name = job[:3]
        row = {"task": task, "model_type": model_type, "class": cls_name, "stage": "none"}
        start = time.perf_counter()
        self.conn.send(job)
        while True:
            left = timeout - (time.perf_counter() - start)
            if left <= 0 or not self.conn.poll(min(left, 5.0)):
                if left <= 0:
                    row["error"] = f"timeout after {timeout:.0f} s"
                    self.stop()
                    break
                if not self.proc.is_alive():
                    row["error"] = f"worker died (exit code {self.proc.exitcode})"
                    self.stop()
                    break
                continue
            try:
                kind, a, b = self.conn.recv()
            except EOFError:
                row["error"] = f"worker died (exit code {self.proc.exitcode})"
                self.stop()
                break
            if kind == "stage":
                if a != "eager":
                    row["stage"] = a
                row.update(b)
            elif kind == "error":
                row["error"], row["trace"] = a, b
                break
            else:
                break
        row["time_s"] = round(time.perf_counter() - start, 1)
        row["reason"] = classify(row)
        return row


# -- classifying failures ------------------------------------------------------------------

def classify(row: dict) -> str:
    """A short reason for where an architecture stopped: 'ok', 'needs X', or the stage
    that failed and a hint of why (read with the error's first line)."""
    err = row.get("error")
    if err is None:
        return "ok" if row["stage"] == "planned" else "?"
    low = err.lower()
    if "skip:" in low:
        return err.split("skip:", 1)[1].strip()
    for marker in ("requires the following packages", "requires the", "pip install",
                   "no module named"):
        if marker in low and row["stage"] == "none":
            return "needs " + _needed(err)
    if err.startswith("timeout"):
        return f"timeout ({row['stage'] if row['stage'] != 'none' else 'building'})"
    stage = {"none": "build", "built": "capture", "captured": "plan"}.get(row["stage"], "?")
    if row.get("eager", "ok") != "ok":
        return f"{stage} error; eager fails too"
    return f"{stage} error" + ("; eager runs" if "eager" in row else "")


def _needed(err: str) -> str:
    import re
    m = re.search(r"No module named '([\w.]+)'", err)
    if m:
        return m.group(1).split(".")[0]
    m = re.search(r"requires the (?:following packages.*?: )?([\w\-., ]+?) librar", err)
    if m:
        return m.group(1).strip()
    return err[:60]


# -- driver --------------------------------------------------------------------------------

def print_table(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table
    table = Table(title="transformers architectures through torchalpa.plan (4 devices)")
    for col in ("task", "model_type", "built", "capt", "plan", "no-rule ops", "s",
                "reason / first error line"):
        table.add_column(col, overflow="fold")

    def reached(row, stage):
        ok = row["stage"] in STAGES and STAGES.index(stage) <= STAGES.index(row["stage"])
        return "yes" if ok else "-"
    order = list(TASKS)
    for r in sorted(rows, key=lambda r: (order.index(r["task"]), r["model_type"])):
        no_rule = r.get("no_rule")
        table.add_row(r["task"], r["model_type"], *(reached(r, s) for s in STAGES),
                      "" if no_rule is None else f"{len(no_rule)} {' '.join(no_rule)}",
                      f"{r['time_s']:.0f}",
                      r["reason"] if r["reason"] == "ok"
                      else f"{r['reason']}: {r.get('error', '')[:160]}")
    Console(width=200).print(table)
    print(summary(rows))
    print("failures by kind: " + ", ".join(
        f"{kind} {count}" for kind, count in failure_kinds(rows).most_common()))


_VALUE_DEPENDENT = ("reads a tensor's value", "depends on tensor values", "data-dependent",
                    "`if ", "`assert ", "`raise ", "`for ")


def failure_kind(row: dict) -> str | None:
    """Whose failure a row is, from its signals alone (None: planned): 'needs package',
    'default config' (transformers' own default config does not build), 'shrinker'
    (the shrunk config does not build or stays too large), 'model rejects the batch'
    (eager fails too), 'value-dependent' (eager runs, but forward branches on, asserts
    on or sizes by tensor values: torchalpa captures one static graph and says so),
    'timeout', or 'torchalpa' (eager runs and the capture or plan failed otherwise)."""
    if row["stage"] == "planned" and "error" not in row:
        return None
    reason, err = row["reason"], row.get("error", "")
    if reason.startswith("needs"):
        return "needs package"
    if "default config does not build" in err:
        return "default config"
    if err.startswith("timeout"):
        return "timeout"
    if row["stage"] == "none":
        return "shrinker"
    if row.get("eager", "ok") != "ok":
        return "model rejects the batch"
    if any(marker in err for marker in _VALUE_DEPENDENT):
        return "value-dependent"
    return "torchalpa"


def failure_kinds(rows: list[dict]):
    import collections
    return collections.Counter(k for r in rows if (k := failure_kind(r)) is not None)


def summary(rows: list[dict]) -> str:
    """Counts per task and overall: architectures, built, captured, planned, no-rule ops."""
    import collections
    lines = []
    for task in [*TASKS, "all"]:
        sel = [r for r in rows if task in ("all", r["task"])]
        if not sel:
            continue
        n = collections.Counter(r["stage"] for r in sel)
        built = sum(n[s] for s in STAGES)
        capt = n["captured"] + n["planned"]
        needs = sum(r["reason"].startswith("needs") for r in sel)
        no_rule = collections.Counter(op for r in sel for op in r.get("no_rule") or ())
        lines.append(f"{task}: {len(sel)} architectures, {needs} need packages, {built} built, "
                     f"{capt} captured, {n['planned']} planned; "
                     f"{sum(bool(r.get('no_rule')) for r in sel)} captured with ops without a "
                     f"rule ({', '.join(f'{op} x{c}' for op, c in no_rule.most_common())})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default=",".join(TASKS),
                    help=f"comma-separated subset of {','.join(TASKS)}")
    ap.add_argument("--only", default="", help="comma-separated model types")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per architecture")
    ap.add_argument("--exact-below", type=int, default=0,
                    help="planner's AutoShardingOption.exact_below (0: simplified ILP only)")
    ap.add_argument("--out", default="hf_sweep.json")
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows already in --out and skip their architectures")
    ap.add_argument("--rerun-failed", action="store_true",
                    help="run again the architectures of --out that failed (and any not in it "
                         "yet), replacing their rows (after a fix)")
    ap.add_argument("--redo", default="",
                    help="comma-separated model types whose rows in --out are run again "
                         "(with --resume or --rerun-failed), e.g. after a rule was added")
    ap.add_argument("--report", metavar="JSON", help="print the table of a finished sweep")
    args = ap.parse_args(argv)
    if args.report:
        with open(args.report) as f:
            print_table(json.load(f))
        return 0
    jobs = architectures(args.task.split(","))
    if args.only:
        only = set(args.only.split(","))
        jobs = [j for j in jobs if j[1] in only]
    rows: list[dict] = []
    if (args.resume or args.rerun_failed) and os.path.exists(args.out):
        with open(args.out) as f:
            rows = json.load(f)
        redo = set(filter(None, args.redo.split(",")))
        done = {(r["task"], r["model_type"]) for r in rows
                if not (args.rerun_failed and "error" in r) and r["model_type"] not in redo}
        jobs = [j for j in jobs if (j[0], j[1]) not in done]
        todo = {(j[0], j[1]) for j in jobs}
        rows = [r for r in rows if (r["task"], r["model_type"]) not in todo]
    runner = Runner()
    try:
        for i, job in enumerate(jobs):
            row = runner.run((*job, args.exact_below), args.timeout)
            rows.append(row)
            print(f"[{i + 1}/{len(jobs)}] {job[0]:7s} {job[1]:28s} {row['stage']:9s} "
                  f"{row['time_s']:6.1f}s {row['reason']}"
                  + (f": {row['error'][:150]}" if "error" in row else ""), flush=True)
            with open(args.out + ".tmp", "w") as f:
                json.dump(rows, f, indent=1)
            os.replace(args.out + ".tmp", args.out)
    finally:
        runner.stop()
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
