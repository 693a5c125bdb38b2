"""Planning real jobs with defaults: ``torchalpa.plan`` with no method (AutoParallel), the
time it takes on this machine, what it chose, and the hand-configured figure beside it.

    python benchmarks/auto_targets.py                      # every target
    python benchmarks/auto_targets.py --targets a d        # some of them
    python benchmarks/auto_targets.py --targets c --rows 350m 1.3b --hand

Targets (all planned without processes, meta weights, AdamW, on simulated clusters):
  a  LLaMA-3-8B, batch 16 x 8192, bf16 mixed precision, 1 x 8 H100 80GB: auto beside
     torchtitan's recipe (FSDP + full activation checkpointing) priced by the same model
  b  LLaMA-2-13B, batch 200 x 4096, 50 nodes x 4 devices of 32 GB (the origin simulation,
     ``llama13b_remat.py``'s cluster): auto beside the hand configuration (PipeshardParallel,
     25 micro-batches, 10 layers, remat full)
  c  GPT-39B, batch 1024 x 1024, 8 x 8 H100: auto beside ``search_39b.py``'s hand-configured
     search (128 micro-batches, 16 layers, remat auto); ``--rows`` adds weak-scaling rows
     (``weak_scaling.py``) beside their best hand grid (``--hand`` computes it: minutes)
  d  transformers' LlamaForCausalLM at LLaMA-3-8B's config, batch 16 x 8192, 8 x 8 devices
     of 16 GB (``Cluster(num_nodes=8, devices_per_node=8)``): a plan or a reasoned refusal
  e  LLaMA-3-70B bf16, batch 128 x 8192, 16 x 8 H100
  f  LLaMA-3.1-405B bf16, batch 64 x 8192, 128 x 8 H100 (1024 GPUs)
  g  GPT-39B, batch 1024 x 1024, 8 x 8 H100, defaults only (target c without the hand row)

Each line: target, seconds (capture included) against its target and the figure recorded
before (``BEFORE``, from RESULTS.md), the chosen method, its estimate against the estimate
recorded before, the planning process's peak memory (``ru_maxrss``, which only grows: each
line's is the peak so far), and the hand-configured estimate with auto/hand (<= 1.00: auto
at least as fast). Times are wall-clock on this machine, which may be shared: the load
average is printed with them. Set ``TORCHALPA_CACHE=0`` (the default here) so the plan
cache does not answer.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import time
from collections.abc import Callable

import torch
from _clusters import v100_like

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.options import (
    AutoLayerOption,
    AutoShardingOption,
    PipeshardParallel,
    Zero3Parallel,
)
from torchalpa.models import hf

GB = 1024 ** 3

TARGET_S = {"a": 20, "b": 60, "c": 30, "d": 60, "e": 60, "f": 120, "g": 30}
"""Seconds each target should plan in on a 2-core machine (capture included)."""
BEFORE: dict[str, tuple[float, float | None]] = {
    "a": (613.4, 2.346), "b": (520.4, 71.99), "d": (1065.5, 5.058), "g": (861.0, 91.86),
    "e": (600.0, None)}
"""(planned-in seconds, estimated s/step) recorded before in RESULTS.md: a and g from
"Targets after pricing alike nodes once" (2026-11-28 20:27-21:11, load 12-18, the 600-s
safety net fired in both), b and d from "Real jobs with the default method" (2026-11-28);
e from "Planning at scale" (2026-11-29, no plan when ``timeout 600`` ended it: the
estimate None); targets not listed had no figure."""


def _meta(workload):
    with torch.device("meta"):
        model = workload.build()
    return model, workload.example_inputs(device="meta"), workload.loss_fn


def _timed(fn: Callable):
    start = time.perf_counter()
    try:
        return fn(), time.perf_counter() - start
    except Exception as e:   # a refusal is an answer: report it with its reason
        return e, time.perf_counter() - start


def _choice(plan) -> str:
    if isinstance(plan, Exception):
        return f"{type(plan).__name__}: {str(plan).splitlines()[0][:160]}"
    kind = plan.method.get("name", "?")
    text = f"{kind}, remat={plan.method.get('remat', 'none')}"
    if hasattr(plan, "stages") and hasattr(plan, "transfers"):
        text += (f", {plan.num_micro_batches} micro-batches, {len(plan.stages)} stages "
                 f"{[list(s.submesh) for s in plan.stages]}")
    else:
        text += (f", {plan.method.get('num_micro_batches', 1)} micro-batches, mesh "
                 f"{'x'.join(map(str, plan.mesh_shape))}")
    return text


def _estimate(plan) -> float | None:
    return None if isinstance(plan, Exception) else plan.estimates.step_time_s


def _before(key: str, seconds: float, est: float | None) -> str:
    """Planned-in time against the target and the recorded figure; the estimate against
    the recorded one."""
    text = f" [target <= {TARGET_S[key]} s: {'met' if seconds <= TARGET_S[key] else 'NOT met'}"
    if key in BEFORE:
        then_s, then_est = BEFORE[key]
        if then_est is None:            # stopped before any plan
            text += f"; before no plan in {then_s:.0f} s"
        else:
            text += f"; before {then_s:.1f} s, est {then_est:.4g}"
        if est is not None and then_est is not None:
            text += f" (est now/before {est / then_est:.3f})"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    return text + f"; peak memory {peak:.2f} GiB]"


def report(name: str, plan, seconds: float, hand=None, hand_label: str = "") -> None:
    est, hand_est = _estimate(plan), _estimate(hand) if hand is not None else None
    key = name.split()[0]
    line = (f"{name}: {seconds:6.1f} s (load {os.getloadavg()[0]:.1f}) | auto: {_choice(plan)}"
            + (f", est {est:.4g} s/step" if est is not None else "")
            + (_before(key, seconds, est) if key in TARGET_S else ""))
    if hand is not None:
        line += f" | hand ({hand_label}): "
        line += f"est {hand_est:.4g} s/step" if hand_est is not None else _choice(hand)
        if est is not None and hand_est is not None:
            line += f" | auto/hand {est / hand_est:.3f}"
    print(line, flush=True)
    if not isinstance(plan, Exception):
        for note in plan.notes:
            if note.startswith(("AutoParallel", "runner-up", "the solver's time limit")):
                print(f"    {note}", flush=True)


def target_a(args) -> None:
    model, batch, loss_fn = _meta(zoo.llama3_8b())
    cluster = torchalpa.Cluster.h100(1, 8)
    bf16 = torchalpa.MixedPrecision(param_dtype=torch.bfloat16)
    plan, seconds = _timed(lambda: torchalpa.plan(model, batch, loss_fn, cluster=cluster,
                                                  mixed_precision=bf16))
    titan = Zero3Parallel(logical_mesh_shape=(8,), auto_sharding_option=AutoShardingOption(
        force_batch_dim_to_mesh_dim=-1, parameters="sharded", rematerialize_parameters=True,
        remat="full"))
    hand, _ = _timed(lambda: torchalpa.plan(model, batch, loss_fn, cluster=cluster,
                                            method=titan, mixed_precision=bf16))
    report("a LLaMA-3-8B bf16 1x8 H100", plan, seconds, hand, "FSDP + full AC")


def target_b(args) -> None:
    model, batch, loss_fn = _meta(zoo.llama2_13b(batch_size=200))
    cluster = v100_like(torchalpa, 50)
    plan, seconds = _timed(lambda: torchalpa.plan(model, batch, loss_fn, cluster=cluster))
    hand = None
    if args.hand:
        method = PipeshardParallel(num_micro_batches=25, layer_option=AutoLayerOption(
            layer_num=10), auto_sharding_option=AutoShardingOption(remat="full"))
        hand, _ = _timed(lambda: torchalpa.plan(model, batch, loss_fn, cluster=cluster,
                                                method=method))
    report("b LLaMA-2-13B 50x4 32GB", plan, seconds, hand,
           "PipeshardParallel(25 micro-batches, 10 layers, remat full)")


def target_c(args) -> None:
    model, batch, loss_fn = _meta(zoo.gpt_39b())
    cluster = torchalpa.Cluster.h100(num_nodes=8)
    plan, seconds = _timed(lambda: torchalpa.plan(model, batch, loss_fn, cluster=cluster))
    hand = None
    if args.hand:
        method = PipeshardParallel(num_micro_batches=128,
                                   layer_option=AutoLayerOption(layer_num=16),
                                   auto_sharding_option=AutoShardingOption(remat="auto"))
        hand, _ = _timed(lambda: torchalpa.plan(model, batch, loss_fn, cluster=cluster,
                                                method=method))
    report("c GPT-39B 8x8 H100", plan, seconds, hand,
           "PipeshardParallel(128 micro-batches, 16 layers, remat auto)")
    for row in args.rows:
        weak_row(row, args)


def weak_row(name: str, args) -> None:
    """One weak-scaling row: auto with defaults beside the row's best hand grid."""
    import weak_scaling as ws
    row = ws.ROWS[name]
    cluster = torchalpa.Cluster.h100(num_nodes=max(1, row.devices // 8),
                                     devices_per_node=min(8, row.devices))
    config = zoo.GPTConfig(vocab_size=ws.VOCAB, max_seq_len=ws.SEQ, num_layers=row.layers,
                           num_heads=row.heads, hidden=row.hidden, dropout=0.0)
    model, batch, loss_fn = _meta(zoo.Workload("gpt", config, ws.GLOBAL_BATCH, ws.SEQ))
    plan, seconds = _timed(lambda: torchalpa.plan(model, batch, loss_fn, cluster=cluster))
    best, label = None, "best grid"
    if args.hand:
        best_step = float("inf")
        for num_micro in (16, 64):
            variants = ws.captures(row, ws.GLOBAL_BATCH // num_micro)
            base = PipeshardParallel(num_micro_batches=num_micro,
                                     layer_option=AutoLayerOption(layer_num=8))
            for remat in ("none", "full"):
                for pp, dp, tp in ws.grids(row.devices, cluster.devices_per_node,
                                           ws.GLOBAL_BATCH // num_micro, 8):
                    step = ws.grid_step(variants[remat].graph, cluster, pp, dp, tp, 8, base)
                    if step < best_step:
                        best_step = step
                        label = f"grid pp{pp} dp{dp} tp{tp} B{num_micro} remat {remat}"
        best = _Step(best_step)
    report(f"c weak {name} ({row.devices} H100)", plan, seconds, best, label)


class _Step:
    """A hand grid's step time, shaped like a plan for ``report``."""

    def __init__(self, step_s: float):
        self.estimates = {"step_time_s": step_s}


def target_d(args) -> None:
    config = hf.hf_config("llama", hidden_size=4096, intermediate_size=14336,
                          num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                          vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
    model, batch, loss_fn = _meta(zoo.Workload("hf_llama", config, 16, 8192))
    cluster = torchalpa.Cluster(num_nodes=8, devices_per_node=8)
    plan, seconds = _timed(lambda: torchalpa.plan(model, batch, loss_fn, cluster=cluster))
    report("d HF LlamaForCausalLM 8B 8x8 16GB", plan, seconds)
    if isinstance(plan, Exception):
        print("    " + str(plan).replace("\n", "\n    "))


def _llama_bf16(key: str, label: str, workload, cluster) -> None:
    model, batch, loss_fn = _meta(workload)
    bf16 = torchalpa.MixedPrecision(param_dtype=torch.bfloat16)
    plan, seconds = _timed(lambda: torchalpa.plan(model, batch, loss_fn, cluster=cluster,
                                                  mixed_precision=bf16))
    report(f"{key} {label}", plan, seconds)
    if isinstance(plan, Exception):
        print("    " + str(plan).replace("\n", "\n    "))


def target_e(args) -> None:
    _llama_bf16("e", "LLaMA-3-70B bf16 16x8 H100", zoo.llama3_70b(),
                torchalpa.Cluster.h100(num_nodes=16))


def target_f(args) -> None:
    _llama_bf16("f", "LLaMA-3.1-405B bf16 128x8 H100", zoo.llama3_405b(),
                torchalpa.Cluster.h100(num_nodes=128))


def target_g(args) -> None:
    model, batch, loss_fn = _meta(zoo.gpt_39b())
    cluster = torchalpa.Cluster.h100(num_nodes=8)
    plan, seconds = _timed(lambda: torchalpa.plan(model, batch, loss_fn, cluster=cluster))
    report("g GPT-39B 8x8 H100", plan, seconds)


TARGETS = {"a": target_a, "b": target_b, "c": target_c, "d": target_d, "e": target_e,
           "f": target_f, "g": target_g}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--rows", nargs="*", default=[],
                   help="weak-scaling rows for target c (350m 1.3b 2.6b 6.7b 15b 39b)")
    p.add_argument("--hand", action="store_true",
                   help="also plan the hand configurations of b and c (minutes each)")
    args = p.parse_args()
    os.environ.setdefault("TORCHALPA_CACHE", "0")
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TORCHALPA_LOG", "warning")
    for name in args.targets:
        TARGETS[name](args)


if __name__ == "__main__":
    main()
