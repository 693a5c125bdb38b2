"""Human-readable views of a Plan: ``summary()`` and ``explain(name)``."""

from __future__ import annotations

from collections import Counter

from torchalpa.placement import long_form, short

__all__ = ["plan_summary", "explain", "format_bytes"]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*["-" * w for w in widths])] + \
        [fmt.format(*[str(c) for c in r]) for r in rows]


def plan_summary(plan) -> str:
    est = plan.estimates
    mesh = " x ".join(f"{n}={s}" for n, s in zip(plan.axis_names, plan.mesh_shape))
    lines = [f"torchalpa plan  mesh [{mesh}]  method {plan.method.get('name', '?')}"]
    if est:
        lines.append(
            f"estimated step {est.get('step_time_s', 0) * 1e3:.3f} ms "
            f"(compute {est.get('compute_s', 0) * 1e3:.3f} ms, communication "
            f"{est.get('communication_s', 0) * 1e3:.3f} ms); memory per device "
            f"{format_bytes(est.get('memory_per_device_bytes', 0))} (model states "
            f"{format_bytes(est.get('model_state_bytes_per_device', 0))}, activations "
            f"{format_bytes(est.get('activation_bytes_per_device', 0))})")
    lines.append("")
    lines.append("parameters:")
    rows = [[p.name, "x".join(map(str, p.shape)), short(p.placements)] for p in plan.parameters]
    lines += ["  " + r for r in _table(rows, ["name", "shape", "placement"])]
    if plan.inputs:
        lines.append("")
        lines.append("inputs:")
        rows = [[p.name, "x".join(map(str, p.shape)), short(p.placements)] for p in plan.inputs]
        lines += ["  " + r for r in _table(rows, ["name", "shape", "placement"])]
    lines.append("")
    total = sum(c.bytes for c in plan.collectives)
    lines.append(f"collectives per step: {len(plan.collectives)} "
                 f"({format_bytes(total)} contributed per rank)")
    if plan.collectives:
        rows = [[c.phase, c.kind + (f"({c.reduce_op})" if c.reduce_op not in (None, 'sum') else ""),
                 plan.axis_names[c.axis], format_bytes(c.bytes), c.source or "<top>", c.tensor]
                for c in plan.collectives]
        lines += ["  " + r for r in _table(rows, ["phase", "kind", "axis", "bytes", "source",
                                                  "tensor"])]
        counts = Counter((c.phase, c.kind) for c in plan.collectives)
        lines.append("  totals: " + ", ".join(f"{k[0]} {k[1]} x{v}" for k, v in sorted(counts.items())))
    if plan.unsupported_ops:
        lines.append("")
        lines.append("ops without a sharding rule (run replicated):")
        for u in plan.unsupported_ops:
            lines.append(f"  {u['op']}  node {u['node']}" + (f"  module {u['module']}" if u.get("module") else ""))
    for note in plan.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def explain(plan, name: str) -> str:
    """Where a parameter, input or op lives, and the collectives that move it."""
    value = next((p for p in plan.parameters + plan.inputs if p.name == name or p.node == name), None)
    if value is not None:
        node = value.node
        head = f"{value.name}: shape {list(value.shape)}, placement {short(value.placements)} " \
               f"({', '.join(long_form(p) for p in value.placements)})"
    else:
        try:
            strategy = plan.strategy(name)
        except KeyError:
            raise KeyError(f"{name!r} is neither a parameter, an input nor an op of this plan") from None
        node = name
        head = f"op {name}: strategy {strategy}"
    moves = [c for c in plan.collectives if c.tensor == node]
    if value is not None:
        grad_sources = {r.producer for r in plan.reshards if r.slot == f"grad:{value.name}"}
        moves += [c for c in plan.collectives if c.tensor in grad_sources and c.phase == "backward"]
    lines = [head]
    why = plan.explanations.get(value.name) if value is not None else None
    if why:
        lines.append(f"  it causes {why['communication_s'] * 1e3:.4g} ms of communication per step "
                     f"(its readers and its gradient) and holds {format_bytes(why['state_bytes'])} "
                     "of state per device")
        other = why.get("runner_up")
        if other:
            lines.append(f"  runner-up {' '.join(other['placements'])}: "
                         f"{other['communication_s'] * 1e3:.4g} ms, "
                         f"{format_bytes(other['state_bytes'])} (every other decision unchanged)")
    if moves:
        lines.append("collectives moving it (or its gradient):")
        lines += [f"  {c.phase} {c.kind} on {plan.axis_names[c.axis]}: {format_bytes(c.bytes)}"
                  for c in moves]
    else:
        lines.append("no collective moves it or its gradient")
    return "\n".join(lines)


def pipeline_summary(plan) -> str:
    est = plan.estimates
    lines = [f"torchalpa pipeline plan  cluster {plan.mesh_shape[0]} node(s) x "
             f"{plan.mesh_shape[1]} devices  {len(plan.stages)} stages  "
             f"{plan.num_micro_batches} micro-batches  schedule {plan.schedule}"]
    if "step_time_s" in est:
        source = " from stage times measured on the devices" \
            if est.get("stage_times") == "measured" else ""
        lines.append(f"estimated step {est['step_time_s'] * 1e3:.3f} ms "
                     f"(slowest stage {est.get('max_stage_s', 0) * 1e3:.3f} ms per micro-batch)"
                     + source)
    lines.append(f"forward_stage_layer_ids = {plan.forward_stage_layer_ids}")
    lines.append(f"submesh_shapes = {[list(s) for s in plan.submesh_shapes]}")
    lines.append(f"logical_mesh_shapes = {[list(s) for s in plan.logical_shapes]}")
    lines.append(f"stage_options = {plan.stage_options}")
    lines.append("")
    rows = []
    stage_seconds = est.get("stage_step_s") or [s.plan.estimates.get("step_time_s", 0)
                                                 for s in plan.stages]
    for s in plan.stages:
        e = s.plan.estimates
        rows.append([str(s.index), f"{s.layers[0]}-{s.layers[-1]}", "x".join(map(str, s.submesh)),
                     "x".join(map(str, s.plan.mesh_shape)), str(list(s.ranks)),
                     f"{stage_seconds[s.index] * 1e3:.3f}",
                     format_bytes(e.get('memory_per_device_bytes', 0)),
                     str(len(s.plan.collectives))])
    lines += _table(rows, ["stage", "layers", "submesh", "logical", "ranks", "ms/micro-batch",
                           "memory/device", "collectives"])
    if plan.transfers:
        lines.append("")
        each = [t for t in plan.transfers if not t.once_per_step]
        lines.append(f"transfers per micro-batch: {len(each)} "
                     f"({format_bytes(sum(t.bytes for t in each))}); once per step: "
                     f"{len(plan.transfers) - len(each)} "
                     f"({format_bytes(sum(t.bytes for t in plan.transfers if t.once_per_step))})")
        for t in plan.transfers:
            lines.append(f"  {t.phase:<8} stage {t.src_stage} -> {t.dst_stage}  "
                         f"{format_bytes(t.bytes):>10}  {t.producer}"
                         + (("  (parameter: once per step)" if t.phase == "forward" else
                             "  (summed over micro-batches: once per step)")
                            if t.once_per_step else ""))
    timeline = est.get("timeline")
    if timeline:
        lines.append("")
        lines.append("estimated timeline (F/B = forward/backward of a micro-batch):")
        lines += _gantt(timeline, est.get("step_time_s", 0))
    for note in plan.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _gantt(timeline, total, width: int = 64) -> list[str]:
    out = []
    scale = width / total if total else 0
    for s, actions in enumerate(timeline):
        row = [" "] * width
        for kind, m, start, end in actions:
            a, b = int(start * scale), max(int(start * scale) + 1, int(end * scale))
            for x in range(a, min(b, width)):
                row[x] = kind if kind == "F" else "b"
            label = str(m % 10)
            if a < width:
                row[a] = label
        out.append(f"  stage {s} |" + "".join(row) + "|")
    return out
