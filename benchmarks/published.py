"""Published training runs, re-estimated by torchalpa's cost model with their plans pinned.

    cd benchmarks && python published.py                  # every row (tens of minutes)
    python published.py --check                           # every row, then the targets
    python published.py --rows alpa-2.6b megatron20-v100-1b --detail
    python published.py --rows mpt-7b-a100x8 --auto       # and what AutoParallel finds
    python published.py --held-out --check --detail       # the held-out rows alone
    python published.py --list                            # the rows, their sources

Each row is a training run someone measured and published (figures and their sources:
``published_rows.py``; the check set was collected in the issue's notes). The model is
built on the meta device from the zoo (``torchalpa.models``: GPT-2/3-style ``gpt``,
LLaMA-style ``llama``) at the published size, computing in the published precision
(``MixedPrecision``: fp32 master weights, the forward in fp16 or bf16), and planned for
the published hardware (``Cluster.preset``: a machine of ``gpu_specs.NODE_PRESETS``) with
the published plan pinned:

- data x tensor parallelism: the logical mesh ``(dp, tp)`` of each stage, the batch on
  ``dp``, Megatron's column/row-parallel Linear layers on ``tp`` (``expert_plans.
  megatron_pins``) and, for the GPT, its vocabulary-parallel token embedding (split by
  vocabulary rows on ``tp``; the tied head with it); the rest, the loss included, as the
  ILP likes, except on rows that ran Megatron's plain tensor parallelism (``plain_tp``:
  Megatron-LM and Megatron-DeepSpeed before sequence parallelism), where the norms stay
  whole on every tp rank and each matmul reads its weight in its tp split
  (``AutoShardingOption(plain_tensor_parallel=True)``), as those runs did; the Megatron
  rows' models carry Megatron's default dropout (0.1, hidden and attention);
- pipeline parallelism: the model cut into ``pp`` equal groups of blocks by
  pipeline-boundary markers (embedding with the first, head and loss with the last, as
  Megatron and DeepSpeed place them), one stage each on ``dp x tp`` devices (pp outermost
  in the device order, tp innermost), the published number of micro-batches, 1F1B;
- full activation recomputation (``frontends/block_remat.py``) where the run used it
  (under ZeRO-1 the recompute reads the weights' casts forward made, as DeepSpeed holds
  the bf16 weights it gathers once a step), selective (the compute-heavy ops' results
  kept, torchtitan's op policy) where it used that;
- ZeRO: optimizer states, gradients and parameters sharded over ``dp`` where the run
  sharded them (FSDP's reshard-after-forward where it used it; ZeRO-1's gradients
  all-reduced whole); with several micro-batches ZeRO-1/2 gather the parameters once per
  step, in pipeline stages too;
- the device's memory as the budget: the published configuration ran there;
- elementwise ops priced as fused (``AutoShardingOption(elementwise="fused")``) for runs
  whose framework fuses them (Megatron's fused kernels, XLA, ``torch.compile``);
- the trainer's own work each micro-batch where the run's trainer did some
  (``PublishedRow.trainer_metrics``: Composer's training metrics on llm-foundry's rows),
  its ops priced by the same cost model (``trainer_work``) and added to the plan's step.

Printed per row: the published step time (measured, or derived [D] from a published
TFLOP/s or tokens/s with the source's own FLOP count), the estimate, estimate / published,
and the memory per device where the source gives it. Comparing step times sidesteps the
FLOP-counting conventions (recomputation counted or not, embeddings counted or not): a
TFLOP/s figure is turned into seconds with exactly the formula its source used.
``--detail`` also prints each plan's compute / communication split and stage times, and
the trainer's metrics as their own term (``+ trainer metrics``; the estimate includes it).
AutoParallel's plan (``--auto``) is held against the pinned plan's step without that term.

The rows come in two sets (``published_rows``): ``TUNED``, the runs the cost model was
developed against, and ``HELD_OUT``, runs added after it that no cost-model change had
been measured against; ``--check`` over a run with both also prints the targets over the
held-out rows alone (``--held-out`` runs only those).

``--check`` prints, after the rows, the targets the estimate is held to: at least 80% of
the rows within 15% of the published step, the mean est/pub within [0.95, 1.05], none
beyond 1.3x either way, the memory within 10% where the source publishes a comparable
peak, and every published configuration within the planner's memory budget on the device
it ran on (it ran there). ``--auto`` also plans each row with ``AutoParallel`` (no method:
the row's model, global batch, precision and cluster) and prints its estimate beside the
published configuration's, then the target it is held to (with ``--check`` or without):
AutoParallel's plan at or below the published plan's estimate in every row run (minutes
per row; hours for the largest clusters' pipeline searches). With ``--detail`` it also
prints the plan AutoParallel chose (mesh or stages, micro-batches, parameter layouts), its
choice notes and how long it planned; on a row whose published configuration is refused
it still plans the row.
"""

from __future__ import annotations

import argparse
import logging
import time
from dataclasses import dataclass

import torch
from expert_plans import megatron_pins
from published_rows import HELD_OUT, ROWS, PublishedRow
from trainer_work import trainer_seconds

import torchalpa
import torchalpa.models as zoo
from torchalpa.core.options import AutoLayerOption, ManualStageOption, PipeshardParallel
from torchalpa.frontends.block_remat import checkpointed_capture
from torchalpa.frontends.torch_export import capture
from torchalpa.runtime.execution.precision import CastForward

GIB = 2 ** 30
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
LLAMA_COLUMNS = r"layers\.\d+\.(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.weight"
LLAMA_ROWS = r"layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj)\.weight"


@dataclass(frozen=True)
class Estimate:
    """What the cost model says of one row."""

    step_s: float
    memory_bytes: float
    compute_s: float | None
    communication_s: float | None
    hidden_s: float | None
    stage_s: tuple[float, ...]
    plan_seconds: float
    trainer_s: float = 0.0
    """Of ``step_s``, the trainer's per-micro-batch metrics (``trainer_work``), added
    after the plan's step: they run on the compute stream between micro-batches."""

    @property
    def plan_step_s(self) -> float:
        """The plan's own step, without the trainer's metrics."""
        return self.step_s - self.trainer_s


def workload(row: PublishedRow) -> zoo.Workload:
    """The zoo model of ``row`` with one micro-batch of every data-parallel replica."""
    config = zoo.FAMILIES[row.family].tiny_config(**row.config)
    return zoo.Workload(row.family, config, row.micro_batch * row.dp, row.seq)


def stage_blocks(row: PublishedRow) -> list[int]:
    """Blocks per pipeline stage: the published partition, else as equal as they go."""
    if row.stage_blocks:
        return list(row.stage_blocks)
    layers = row.config["num_layers"]
    return [layers * (s + 1) // row.pp - layers * s // row.pp for s in range(row.pp)]


def build(row: PublishedRow, batch: int | None = None):
    """(model, example batch, loss) on the meta device, computing in the row's precision,
    with a pipeline-boundary marker after the last block of every stage but the last;
    ``batch``: sequences in the example (default: one micro-batch of every replica)."""
    w = workload(row)
    if batch is not None:
        w = zoo.Workload(w.family, w.config, batch, w.seq_len)
    with torch.device("meta"):
        model, batch = w.build(), w.example_inputs()
    blocks = model.h if row.family == "gpt" else model.layers
    if row.pp > 1:
        for end in [sum(stage_blocks(row)[:s + 1]) - 1 for s in range(row.pp - 1)]:
            blocks[end].register_forward_hook(_mark_boundary)
    if row.precision in DTYPES:
        cast_per_module(model, blocks, DTYPES[row.precision], row.float32_logits)
    return model, batch, w.loss_fn


def _mark_boundary(module, inputs, output):
    return torchalpa.mark_pipeline_boundary(output)


def cast_per_module(model: torch.nn.Module, blocks: torch.nn.ModuleList,
                    dtype: torch.dtype, float32_logits: bool = True) -> None:
    """Each block and each other top-level module computing in ``dtype`` from float32
    master weights (``CastForward`` on each, names unchanged), the head's logits cast back
    to float32 for the loss (``float32_logits``). Casting per module puts each cast in the pipeline stage that
    uses the weight, as FSDP's per-module mixed precision does (one ``CastForward`` around
    the whole model casts every weight at the start of forward, all in the first stage)."""
    inner = torchalpa.MixedPrecision(param_dtype=dtype, output_dtype=None)
    head = torchalpa.MixedPrecision(param_dtype=dtype,
                                    output_dtype=torch.float32 if float32_logits else None)
    for i, block in enumerate(blocks):
        blocks[i] = CastForward(block, inner)
    children = [name for name, m in model.named_children()
                if m is not blocks and any(True for _ in m.parameters())]
    for name in children:
        setattr(model, name, CastForward(getattr(model, name),
                                         head if name == children[-1] else inner))


def stage_option(row: PublishedRow) -> tuple[tuple[int, ...], torchalpa.AutoShardingOption]:
    """The logical mesh of a stage and the options pinning the published layout."""
    fused = "fused" if row.fused else "eager"
    # planned within the memory of the device it ran on (the cluster's, the default
    # budget): among plans of one step time the ILP keeps one that fits, as the run did
    common: dict = dict(elementwise=fused, solver="highs")
    if row.zero != "none":
        common["parameters"] = "sharded"
        common["rematerialize_parameters"] = row.zero == "fsdp"
    if row.zero == "zero1":     # gradients all-reduced whole, as Zero1Parallel
        common["allow_reduce_scatter"] = False
    if row.plain_tp and row.tp > 1:     # norms whole on every tp rank (the last axis)
        common["plain_tensor_parallel"] = True
    if row.family == "gpt":
        def pins(tp_axis: int, ndim: int, other: str = "R") -> dict:
            # a strided (by-head) shard of the fused QKV weight takes no shard over dp:
            # with ZeRO the ILP lays c_attn out itself
            # Megatron's VocabParallelEmbedding: the embedding (and the tied head) split
            # by vocabulary rows over tp
            vocab = {r"wte\.weight": tuple("S(0)" if a == tp_axis else other
                                            for a in range(ndim))}
            return {k: v for k, v in {**megatron_pins(tp_axis, ndim, other), **vocab}.items()
                    if other == "R" or "c_attn" not in k}
    else:
        def pins(tp_axis: int, ndim: int, other: str = "R") -> dict:
            def on(p):
                return tuple(p if a == tp_axis else other for a in range(ndim))
            return {LLAMA_COLUMNS: on("S(0)"), LLAMA_ROWS: on("S(1)")}
    other = "*" if row.zero != "none" else "R"
    if row.tp == 1:
        return (row.dp,), torchalpa.AutoShardingOption(force_batch_dim_to_mesh_dim=0, **common)
    if row.dp == 1:
        return (row.tp,), torchalpa.AutoShardingOption(pin=pins(0, 1), **common)
    return (row.dp, row.tp), torchalpa.AutoShardingOption(
        force_batch_dim_to_mesh_dim=0, pin=pins(1, 2, other), **common)


def method(row: PublishedRow):
    """The published plan as a torchalpa method."""
    logical, option = stage_option(row)
    micro_batches = row.global_batch // (row.micro_batch * row.dp)
    if row.pp == 1:
        return torchalpa.ShardParallel(logical_mesh_shape=logical, auto_sharding_option=option,
                                       num_micro_batches=micro_batches)
    per_stage = row.dp * row.tp
    cluster = row.cluster()
    per_node = cluster.devices_per_node
    submesh = (per_stage // per_node, per_node) if per_stage >= per_node else (1, per_stage)
    return PipeshardParallel(
        num_micro_batches=micro_batches, layer_option=AutoLayerOption(layer_num="auto"),
        pipeline_schedule=row.schedule, auto_sharding_option=option,
        stage_option=ManualStageOption(
            forward_stage_layer_ids=[[s] for s in range(row.pp)],
            submesh_shapes=[submesh] * row.pp, logical_shapes=[logical] * row.pp,
            options=[option] * row.pp))


def pinned_step(row: PublishedRow):
    """The row's training step captured as the run ran it (its recomputation, its ZeRO's
    parameter reads); the other benchmarks over the rows use it."""
    model, batch, loss_fn = build(row)
    # FSDP / ZeRO-3 gathers parameters again in backward: backward reads views of its own
    captured = capture(model, batch, loss_fn, rematerialize_parameters=row.zero == "fsdp")
    if row.remat != "none":
        # DeepSpeed's ZeRO-1 gathers the updated bf16 weights once a step and holds them
        # through forward and recompute: the recompute reads forward's casts; Alpa's
        # ZeRO-2-like layout (XLA's remat) recomputes inside the layer, casts included
        captured = checkpointed_capture(captured, row.remat,
                                        keep_parameter_values=row.zero == "zero1")
    return captured.graph


def pinned_plan(row: PublishedRow, graph=None):
    """The row's step (``pinned_step`` unless given) planned with its published plan pinned:
    one stage on its mesh, or its pipeline."""
    from torchalpa.parallel.shard import candidate_meshes, plan_graph
    from torchalpa.passes.pipeline_search.inter_op import plan_pipeline
    graph = pinned_step(row) if graph is None else graph
    cluster = row.cluster()
    m = method(row)
    if row.pp == 1:
        return plan_graph(graph, method=m, meshes=candidate_meshes(cluster, m),
                          blocks=graph.meta.get("repeated_blocks"))
    return plan_pipeline(graph, cluster, m)


def estimate(row: PublishedRow) -> Estimate:
    """Capture the row's step, pin its plan, and read the plan's estimates."""
    start = time.perf_counter()
    plan = pinned_plan(row)
    e = plan.estimates
    trainer_s = trainer_seconds(row)
    return Estimate(step_s=e.step_time_s + trainer_s, memory_bytes=e.memory_per_device_bytes,
                    compute_s=e.compute_s, communication_s=e.communication_s,
                    hidden_s=e.hidden_communication_s,
                    stage_s=tuple(e.stage_step_s or ()),
                    plan_seconds=time.perf_counter() - start, trainer_s=trainer_s)


@dataclass(frozen=True)
class AutoEstimate:
    """What AutoParallel planned for one row: its step estimate, the plan it chose (as
    ``plan_layout`` writes it, then the plan's own choice notes) and how long it took."""

    step_s: float
    chosen: str
    plan_seconds: float


def auto_estimate(row: PublishedRow) -> AutoEstimate:
    """The step AutoParallel's plan estimates for the row's model, global batch and
    cluster, no method given (it picks mesh, pipeline, micro-batches, checkpointing).
    Priced as the row's step runs (compiled: elementwise chains fused), as its pinned plan
    is; that is how the step executes, not a choice of plan."""
    start = time.perf_counter()
    model, batch, loss_fn = build(row, batch=row.global_batch)
    option = torchalpa.AutoShardingOption(elementwise="fused" if row.fused else "eager")
    plan = torchalpa.plan(model, batch, loss_fn, cluster=row.cluster(),
                          method=torchalpa.AutoParallel(auto_sharding_option=option))
    seconds = time.perf_counter() - start
    chosen = "\n".join([plan_layout(plan), plan.explain_choice()])
    return AutoEstimate(step_s=plan.estimates.step_time_s, chosen=chosen,
                        plan_seconds=seconds)


def plan_layout(plan) -> str:
    """One line on a plan's shape, to set beside the published configuration: its mesh
    (a pipeline's stages and submeshes), micro-batches and how many parameters take each
    layout (sharded over the batch axis: ZeRO / FSDP's layouts)."""
    stages = getattr(plan, "num_micro_batches", None) is not None
    plans = [s.plan for s in plan.stages] if stages else [plan]
    layouts: dict[str, int] = {}
    for p in plans:
        for v in p.parameters:
            key = "".join(str(x) for x in v.placements)
            layouts[key] = layouts.get(key, 0) + 1
    common = ", ".join(f"{k} x{n}" for k, n in sorted(layouts.items(), key=lambda kv: -kv[1]))
    if stages:
        shapes = ", ".join(f"{list(s.submesh)}->{list(s.plan.mesh_shape)}" for s in plan.stages)
        return (f"pipeline of {len(plan.stages)} stages ({shapes}), "
                f"{_micro_batches(plan.num_micro_batches)}, {plan.schedule}; "
                f"parameter layouts {common}")
    micro = _micro_batches(plan.method.get("num_micro_batches", 1))
    return f"mesh {list(plan.mesh_shape)}, {micro}; parameter layouts {common}"


def _micro_batches(n: int) -> str:
    return f"{n} micro-batch{'es' if n > 1 else ''}"


@dataclass(frozen=True)
class Outcome:
    """One row's published figures and estimates, as ``--check`` judges them."""

    row: PublishedRow
    estimate: Estimate
    auto_step_s: float | None = None
    auto: AutoEstimate | None = None
    """AutoParallel's plan of the row (``--auto``), whose step is ``auto_step_s``."""

    @property
    def ratio(self) -> float:
        return self.estimate.step_s / self.row.published_step_s()

    @property
    def memory_ratio(self) -> float | None:
        r = self.row
        return self.estimate.memory_bytes / GIB / r.memory_gib \
            if r.memory_gib and r.memory_comparable else None

    @property
    def budget_bytes(self) -> float:
        return self.row.cluster().memory_per_device


def check(outcomes: list[Outcome]) -> list[tuple[str, bool]]:
    """The targets (module doc), each as (what it says, whether it holds)."""
    ratios = [o.ratio for o in outcomes]
    within = sum(abs(q - 1) <= 0.15 for q in ratios)
    mean = sum(ratios) / len(ratios)
    worst = max(ratios, key=lambda q: max(q, 1 / q))
    memory = [(o.row.key, o.memory_ratio) for o in outcomes if o.memory_ratio is not None]
    off = [f"{k} {q:.2f}" for k, q in memory if abs(q - 1) > 0.10]
    over = [f"{o.row.key} {o.estimate.memory_bytes / GIB:.1f} > {o.budget_bytes / GIB:.1f} GiB"
            for o in outcomes if o.estimate.memory_bytes > o.budget_bytes]
    out = [(f"{within} of {len(ratios)} rows within 15% of the published step "
            f"(target: at least 80%)", within >= 0.8 * len(ratios)),
           (f"mean est/pub {mean:.3f} (target: within [0.95, 1.05])", 0.95 <= mean <= 1.05),
           (f"farthest est/pub {worst:.2f} (target: none beyond 1.3x either way)",
            max(worst, 1 / worst) <= 1.3),
           (f"memory within 10% of the published peak in {len(memory) - len(off)} of "
            f"{len(memory)} rows" + (f" (off: {', '.join(off)})" if off else ""), not off),
           (f"{len(outcomes) - len(over)} of {len(outcomes)} published configurations fit "
            f"the planner's memory budget on their device" +
            (f" (over: {', '.join(over)})" if over else ""), not over)]
    auto = auto_target(outcomes)
    return out + ([auto] if auto else [])


def auto_target(outcomes: list[Outcome]) -> tuple[str, bool] | None:
    """The target ``--auto`` holds AutoParallel to: its plan at or below the published
    configuration's estimate in every row it planned (None: no row was planned so)."""
    autos = [o for o in outcomes if o.auto_step_s is not None]
    if not autos:
        return None
    # plan against plan: AutoParallel's estimate does not carry the trainer's metrics
    slower = [f"{o.row.key} {o.auto_step_s / o.estimate.plan_step_s:.3f}x" for o in autos
              if o.auto_step_s > o.estimate.plan_step_s * (1 + 1e-6)]
    worst = max(o.auto_step_s / o.estimate.plan_step_s for o in autos)
    return (f"AutoParallel's plan at or below the published plan's estimate in "
            f"{len(autos) - len(slower)} of {len(autos)} rows run (auto / pinned at most "
            f"{worst:.3f}; target: every row)" +
            (f" (slower: {', '.join(slower)})" if slower else ""), not slower)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="+", metavar="ROW",
                   help="rows to estimate (default: all; --list names them)")
    p.add_argument("--held-out", action="store_true",
                   help="only the held-out rows (published_rows.HELD_OUT)")
    p.add_argument("--list", action="store_true", help="list the rows and their sources")
    p.add_argument("--detail", action="store_true", help="compute/communication, stages")
    p.add_argument("--check", action="store_true", help="print the targets after the rows")
    p.add_argument("--auto", action="store_true",
                   help="also plan each row with AutoParallel (minutes per row)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    known = {r.key for r in ROWS}
    unknown = [k for k in args.rows or () if k not in known]
    if unknown:
        p.error(f"unknown row(s) {', '.join(unknown)}; the rows are: {', '.join(sorted(known))}")
    rows = [r for r in ROWS if (not args.rows or r.key in args.rows)
            and (not args.held_out or r in HELD_OUT)]
    if args.list:
        for r in rows:
            print(f"{r.key:<24} {r.label}\n{'':<24} {r.source}\n{'':<24} {r.plan_text()}")
        return
    print(f"{'row':<24}{'published s':>12}{'estimate s':>12}{'est/pub':>9}"
          f"{'pub GiB':>9}{'est GiB':>9}{'est/pub':>9}"
          + (f"{'auto s':>9}" if args.auto else "") + "  source")
    outcomes, refused = [], []
    for r in rows:
        try:
            pinned = estimate(r)
        except (ValueError, NotImplementedError) as e:
            print(f"{r.key}: cannot estimate this row: {e}", flush=True)
            refused.append(r.key)
            if args.auto:       # what AutoParallel makes of a job whose published plan
                _print_auto_alone(r)    # the planner refuses
            continue
        auto = auto_estimate(r) if args.auto else None
        o = Outcome(r, pinned, auto.step_s if auto else None, auto)
        outcomes.append(o)
        _print_row(o, args.detail)
    if not outcomes:
        _print_refused(refused, len(rows), args.check)
        return
    inside = sum(0.8 <= 1 / o.ratio <= 1.2 for o in outcomes)
    print(f"\n{inside} of {len(outcomes)} rows have an estimated throughput within 20% of "
          f"the published one (est/pub step between {1 / 1.2:.3f} and {1 / 0.8:.3f})")
    auto = auto_target(outcomes)
    for text, ok in check(outcomes) if args.check else [auto] if auto else []:
        print(f"{'PASS' if ok else 'FAIL'}  {text}")
    _print_refused(refused, len(rows), args.check)
    held = held_out_outcomes(outcomes)
    if args.check and held and len(held) < len(outcomes):
        print(f"\nthe {len(held)} held-out rows estimated (published_rows.HELD_OUT) alone:")
        for text, ok in check(held):
            print(f"{'PASS' if ok else 'FAIL'}  {text}")
        _print_refused([k for k in refused if k in {r.key for r in HELD_OUT}],
                       sum(r in HELD_OUT for r in rows), args.check)


def held_out_outcomes(outcomes: list[Outcome]) -> list[Outcome]:
    """The outcomes of held-out rows (``published_rows.HELD_OUT``), in table order."""
    keys = {r.key for r in HELD_OUT}
    return [o for o in outcomes if o.row.key in keys]


def _print_refused(refused: list[str], rows: int, check: bool) -> None:
    # a published configuration ran: a row the planner refuses fails the targets too
    if refused and check:
        print(f"FAIL  {len(refused)} of {rows} rows could not be estimated (above: why): "
              f"{', '.join(refused)}")


def _print_row(o: Outcome, detail: bool) -> None:
    r, e = o.row, o.estimate
    published = r.published_step_s()
    gib = e.memory_bytes / GIB
    mem = f"{r.memory_gib:>9.2f}{gib:>9.2f}" + (
        f"{o.memory_ratio:>9.2f}" if o.memory_ratio is not None else f"{'n/c':>9}") \
        if r.memory_gib else f"{'-':>9}{gib:>9.2f}{'-':>9}"
    auto = "" if o.auto_step_s is None else f"{o.auto_step_s:>9.3f}"
    print(f"{r.key:<24}{published:>12.3f}{e.step_s:>12.3f}{o.ratio:>9.2f}{mem}{auto}  "
          f"{r.short_source} ({r.published_text()})", flush=True)
    if detail:
        print(f"{'':<24}{r.plan_text()}; planned in {e.plan_seconds:.0f}s; "
              f"compute {_s(e.compute_s)} comm {_s(e.communication_s)} "
              f"hidden {_s(e.hidden_s)}"
              + (f" + trainer metrics {e.trainer_s:.3f}s" if r.trainer_metrics else "")
              + (f" stages {', '.join(f'{s:.3f}' for s in e.stage_s)} s"
                 if e.stage_s else ""), flush=True)
        if o.auto is not None:
            print(f"{'':<24}AutoParallel, planned in {o.auto.plan_seconds:.0f}s: "
                  + o.auto.chosen.replace("\n", f"\n{'':<26}"), flush=True)


def _print_auto_alone(row: PublishedRow) -> None:
    try:
        auto = auto_estimate(row)
    except (ValueError, NotImplementedError) as e:
        print(f"{'':<24}AutoParallel: cannot plan it either: {e}", flush=True)
        return
    print(f"{'':<24}AutoParallel: {auto.step_s:.3f} s ({auto.step_s / row.published_step_s():.2f}"
          f" of the published step), planned in {auto.plan_seconds:.0f}s: "
          + auto.chosen.replace("\n", f"\n{'':<26}"), flush=True)


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}s"


if __name__ == "__main__":
    main()
