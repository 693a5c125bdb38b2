"""Plans as pictures: one self-contained HTML page, and a Chrome/Perfetto trace.

``plan_html(plan)`` is a single file with inline CSS and SVG (no scripts, no network):
the mesh (or, for a pipeline, which devices each stage holds), the placement of every
parameter as a grid of layers, each device's memory against its budget, the bytes each
module sends, and a pipeline's estimated timeline.

``chrome_trace(plan)`` is the estimated step as trace events (JSON), for
https://ui.perfetto.dev or chrome://tracing. A pipeline plan has a real timeline from its
schedule simulation. An intra-op plan does not: its estimate is a compute time and a
communication time, so the trace lays out forward compute (a third of it, the usual
forward:backward ratio), then backward, and each phase's collectives one after another
on their mesh axis, each taking a share of the communication time proportional to the
bytes it sends. Everything in it is marked as an estimate.
"""

from __future__ import annotations

import html
import json
from collections import defaultdict
from collections.abc import Hashable
from typing import TYPE_CHECKING

from torchalpa.core.placement import short
from torchalpa.core.plan import register_view
from torchalpa.core.units import format_bytes
from torchalpa.views.fold import template
from torchalpa.views.report import rollup_by_module, tensor_labels, wire_bytes

if TYPE_CHECKING:
    from torchalpa.core.plan import ValuePlacement

__all__ = ["plan_html", "chrome_trace"]

_PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1",
            "#ff9da7", "#9c755f", "#bab0ac"]
_CSS = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px}td,th{padding:2px 6px;text-align:left}
td.cell{width:18px;height:16px;padding:0;border:1px solid #fff}
.legend span{display:inline-block;padding:1px 6px;margin:2px;color:#fff;border-radius:3px}
.note{color:#666;font-size:12px}svg text{font:11px system-ui,sans-serif}
"""


def _esc(x) -> str:
    return html.escape(str(x), quote=True)


def _colors(keys) -> dict[Hashable, str]:
    return {k: _PALETTE[i % len(_PALETTE)] for i, k in enumerate(dict.fromkeys(keys))}


def _stages(plan):
    """(stage index, its intra-op plan, its ranks) for either kind of plan."""
    if hasattr(plan, "stages") and plan.stages and hasattr(plan.stages[0], "plan"):
        return [(s.index, s.plan, list(s.ranks)) for s in plan.stages]
    return [(0, plan, list(range(plan.num_devices)))]


# -- sections ---------------------------------------------------------------------------

def _header(plan) -> str:
    est = plan.estimates
    kind = "pipeline plan" if len(_stages(plan)) > 1 or hasattr(plan, "transfers") else "plan"
    shape = " x ".join(map(str, plan.mesh_shape))
    text = f"<h1>torchalpa {kind}: mesh {shape} ({plan.num_devices} devices)</h1>"
    if est.step_time_s is not None:
        text += (f"<p>estimated step {est.step_time_s * 1e3:.3f} ms"
                 + (f" (compute {est.compute_s * 1e3:.3f} ms, communication "
                    f"{est.communication_s * 1e3:.3f} ms)" if est.compute_s is not None else "")
                 + "</p>")
    return text


def _mesh_svg(plan) -> str:
    """Devices as squares, rows x columns of the (first two axes of the) mesh; a pipeline
    colors each device by its stage."""
    stages = _stages(plan)
    shape = list(plan.mesh_shape) + [1] * (2 - len(plan.mesh_shape))
    rows, cols = shape[0], shape[1] if len(shape) > 1 else 1
    stage_of = {r: i for i, _, ranks in stages for r in ranks}
    colors = _colors(range(len(stages)))
    size, gap = 28, 4
    w, h = cols * (size + gap) + 80, rows * (size + gap) + 30
    parts = [f'<svg width="{w}" height="{h}" role="img" aria-label="device mesh">']
    for r in range(rows):
        for c in range(cols):
            rank = r * cols + c
            fill = colors.get(stage_of.get(rank, 0), "#999")
            x, y = 60 + c * (size + gap), 20 + r * (size + gap)
            parts.append(f'<rect x="{x}" y="{y}" width="{size}" height="{size}" fill="{fill}">'
                         f'<title>rank {rank}, stage {stage_of.get(rank, 0)}</title></rect>'
                         f'<text x="{x + 4}" y="{y + 18}" fill="#fff">{rank}</text>')
    names = getattr(plan, "axis_names", ("node", "device"))
    parts.append(f'<text x="60" y="12">{_esc(names[-1] if len(names) > 1 else "")} →</text>')
    parts.append(f'<text x="0" y="34">{_esc(names[0])} ↓</text></svg>')
    legend = ""
    if len(stages) > 1:
        legend = '<div class="legend">' + "".join(
            f'<span style="background:{colors[i]}">stage {i}: {len(ranks)} devices, logical '
            f'{"x".join(map(str, p.mesh_shape))}</span>' for i, p, ranks in stages) + "</div>"
    return "".join(parts) + legend


def _placement_grid(plan) -> str:
    """One row per parameter of a layer, one column per layer index; the cell's color is
    the parameter's placement. Parameters outside repeated layers get a row each."""
    out = []
    # one colour per placement across all stages, so a colour means the same everywhere
    colors = _colors(short(v.placements) for _, p, _ in _stages(plan) for v in p.parameters)
    for index, p, _ in _stages(plan):
        rows: dict[str, dict[int, ValuePlacement]] = defaultdict(dict)
        single = []
        for v in p.parameters:
            tmpl, idx = template(v.name)
            if len(idx) == 1:
                rows[tmpl][idx[0]] = v
            else:
                single.append(v)
        here = dict.fromkeys(short(v.placements) for v in p.parameters)
        title = f"<h3>stage {index}</h3>" if len(_stages(plan)) > 1 else ""
        out.append(title + '<div class="legend">' + "".join(
            f'<span style="background:{colors[k]}">{_esc(k)}</span>' for k in here)
            + "</div>")
        for cells in rows.values():
            if len(cells) == 1:          # a lone numbered module is not a layer
                single += list(cells.values())
        grid = {t: c for t, c in rows.items() if len(c) > 1}
        if grid:
            layers = sorted({i for c in grid.values() for i in c})
            head = "".join(f"<th>{i}</th>" for i in layers)
            body = []
            for tmpl, cells in grid.items():
                tds = []
                for i in layers:
                    v = cells.get(i)
                    if v is None:
                        tds.append('<td class="cell"></td>')
                        continue
                    tip = f"{v.name} {'x'.join(map(str, v.shape))} {short(v.placements)}"
                    tds.append(f'<td class="cell" style="background:{colors[short(v.placements)]}"'
                               f' title="{_esc(tip)}"></td>')
                body.append(f"<tr><td>{_esc(tmpl.replace('{}', '*'))}</td>{''.join(tds)}</tr>")
            out.append(f"<table><tr><th>parameter \\ layer</th>{head}</tr>{''.join(body)}</table>")
        if single:
            out.append("<table>" + "".join(
                f'<tr><td class="cell" style="background:{colors[short(v.placements)]}"></td>'
                f"<td>{_esc(v.name)}</td><td>{'x'.join(map(str, v.shape))}</td>"
                f"<td>{_esc(short(v.placements))}</td></tr>" for v in single) + "</table>")
    return "".join(out)


def _bars(rows: list[tuple[str, float, str]], limit: float | None, unit=format_bytes) -> str:
    """Horizontal bars: (label, value, color); a dashed line at ``limit``."""
    if not rows:
        return '<p class="note">nothing to show</p>'
    top = max([v for _, v, _ in rows] + [limit or 0]) or 1
    width, label_w, bar_h = 520, 300, 18
    h = len(rows) * (bar_h + 4) + 24
    parts = [f'<svg width="{label_w + width + 120}" height="{h}">']
    for i, (label, value, color) in enumerate(rows):
        y = 4 + i * (bar_h + 4)
        parts.append(f'<text x="0" y="{y + 13}">{_esc(label[:48])}</text>'
                     f'<rect x="{label_w}" y="{y}" width="{max(1, value / top * width):.1f}" '
                     f'height="{bar_h}" fill="{color}"><title>{_esc(label)}: {unit(value)}'
                     f'</title></rect><text x="{label_w + value / top * width + 4:.1f}" '
                     f'y="{y + 13}">{unit(value)}</text>')
    if limit:
        x = label_w + limit / top * width
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="{h - 16}" stroke="#c00" '
                     f'stroke-dasharray="4 3"/><text x="{x - 30:.1f}" y="{h - 4}" '
                     f'fill="#c00">budget {unit(limit)}</text>')
    return "".join(parts) + "</svg>"


def _memory(plan) -> str:
    rows = []
    budget = plan.estimates.memory_budget_per_device_bytes
    for index, p, ranks in _stages(plan):
        e = p.estimates
        budget = budget or e.memory_budget_per_device_bytes
        who = f"stage {index}, " if len(_stages(plan)) > 1 else ""
        label = f"{who}ranks {ranks[0]}..{ranks[-1]}" if len(ranks) > 1 else f"rank {ranks[0]}"
        states, acts = (e.model_state_bytes_per_device or 0), \
            (e.activation_bytes_per_device or 0)
        rows.append((f"{label}: model states", states, "#4e79a7"))
        rows.append((f"{label}: activations", acts, "#f28e2b"))
        in_flight = plan.estimates.stage_memory_bytes
        if in_flight and len(_stages(plan)) > 1:   # a pipeline stage holds several micro-batches
            rows.append((f"{label}: total in flight", in_flight[index],
                         "#59a14f"))
        else:
            total = e.memory_per_device_bytes
            rows.append((f"{label}: total (each device)",
                         states + acts if total is None else total, "#59a14f"))
    note = "" if budget else '<p class="note">the plan does not record its memory budget</p>'
    return _bars(rows, budget) + note


def _communication(plan) -> str:
    out = []
    for index, p, _ in _stages(plan):
        labels = tensor_labels(p)
        rolled = rollup_by_module(p, p.collectives)
        rows = [(name + (f" x{n}" if n > 1 else ""), sent, "#e15759")
                for sent, name, _, n, _ in rolled[:20]]
        title = f"<h3>stage {index}</h3>" if len(_stages(plan)) > 1 else ""
        out.append(title + _bars(rows, None))
        listed = "".join(
            f"<tr><td>{_esc(c.phase)}</td><td>{_esc(c.kind)}</td>"
            f"<td>{_esc(p.axis_names[c.axis] if c.axis is not None else '-')}</td>"
            f"<td>{format_bytes(c.bytes)}</td><td>{_esc(c.source or '<top>')}</td>"
            f"<td>{_esc(labels.get(c.tensor, c.tensor))}</td></tr>" for c in p.collectives)
        out.append(f"<details><summary>all {len(p.collectives)} collectives</summary><table>"
                   "<tr><th>phase</th><th>kind</th><th>axis</th><th>bytes</th><th>module</th>"
                   f"<th>tensor</th></tr>{listed}</table></details>")
    return "".join(out)


def _timeline(plan) -> str:
    timeline = plan.estimates.timeline
    total = plan.estimates.step_time_s
    if not timeline or not total:
        return ""
    width, row_h = 860, 22          # + 70 for the labels: fits a 1000-pixel window
    h = len(timeline) * (row_h + 6) + 20
    legend = ('<div class="legend"><span style="background:#4e79a7">forward</span>'
              '<span style="background:#f28e2b">backward</span></div>')
    parts = [f'<h2>estimated pipeline timeline</h2>{legend}'
             f'<svg width="{width + 70}" height="{h}">']
    for s, actions in enumerate(timeline):
        y = 4 + s * (row_h + 6)
        parts.append(f'<text x="0" y="{y + 15}">stage {s}</text>')
        for kind, m, start, end in actions:
            x, w = 70 + start / total * width, max(1.0, (end - start) / total * width)
            color = "#4e79a7" if kind == "F" else "#f28e2b"
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h}" '
                         f'fill="{color}" stroke="#fff"><title>{kind} micro-batch {m}: '
                         f'{start * 1e3:.3f}-{end * 1e3:.3f} ms</title></rect>')
    return "".join(parts) + "</svg>"


@register_view("html")
def plan_html(plan) -> str:
    """The whole page as a string (``Plan.to_html(path)`` writes it)."""
    params = sum(len(p.parameters) for _, p, _ in _stages(plan))
    colls = sum(len(p.collectives) for _, p, _ in _stages(plan))
    body = [_header(plan),
            "<h2>mesh</h2>", _mesh_svg(plan),
            f"<h2>parameter placements ({params})</h2>", _placement_grid(plan),
            "<h2>memory per device</h2>", _memory(plan),
            f"<h2>communication by module ({colls} collectives, bytes sent per rank)</h2>",
            _communication(plan), _timeline(plan)]
    notes = "".join(f"<li>{_esc(n)}</li>" for n in plan.notes)
    if notes:
        body.append(f"<h2>notes</h2><ul>{notes}</ul>")
    return ('<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f"<title>torchalpa plan</title><style>{_CSS}</style></head><body>"
            + "".join(body) + "</body></html>\n")


# -- Chrome trace -------------------------------------------------------------------------

def chrome_trace(plan) -> dict:
    """Trace events (``{"traceEvents": [...]}``, times in microseconds)."""
    events = []
    timeline = plan.estimates.timeline
    if timeline:
        for s, actions in enumerate(timeline):
            events.append({"ph": "M", "name": "process_name", "pid": s,
                           "args": {"name": f"stage {s}"}})
            for kind, m, start, end in actions:
                events.append({"ph": "X", "pid": s, "tid": 0, "ts": start * 1e6,
                               "dur": (end - start) * 1e6,
                               "name": f"{'forward' if kind == 'F' else 'backward'} mb {m}",
                               "cat": "estimate"})
        return {"traceEvents": events, "displayTimeUnit": "ms"}
    for index, p, _ in _stages(plan):
        events += _intra_op_events(p, pid=index)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _intra_op_events(plan, pid: int) -> list[dict]:
    est = plan.estimates
    compute, comm = (est.compute_s or 0.0), (est.communication_s or 0.0)
    forward_end = compute / 3
    events = [{"ph": "M", "name": "process_name", "pid": pid,
               "args": {"name": "estimated step (one device)"}},
              {"ph": "M", "name": "thread_name", "pid": pid, "tid": 0,
               "args": {"name": "compute"}},
              {"ph": "X", "pid": pid, "tid": 0, "ts": 0, "dur": forward_end * 1e6,
               "name": "forward", "cat": "estimate"},
              {"ph": "X", "pid": pid, "tid": 0, "ts": forward_end * 1e6,
               "dur": (compute - forward_end) * 1e6, "name": "backward", "cat": "estimate"}]
    sent = [wire_bytes(plan, c) for c in plan.collectives]
    total = sum(sent) or 1.0
    labels = tensor_labels(plan)
    clock: dict[tuple[str, int], float] = {}
    for axis, name in enumerate(plan.axis_names):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": axis + 1,
                       "args": {"name": f"collectives on {name}"}})
    for c, b in zip(plan.collectives, sent):
        axis = c.axis if c.axis is not None else 0
        start = clock.get((c.phase, axis), 0.0 if c.phase == "forward" else forward_end)
        dur = comm * b / total
        clock[(c.phase, axis)] = start + dur
        events.append({"ph": "X", "pid": pid, "tid": axis + 1, "ts": start * 1e6,
                       "dur": dur * 1e6, "name": f"{c.kind} {c.source or '<top>'}",
                       "cat": "estimate", "args": {"bytes": c.bytes, "phase": c.phase,
                                                   "tensor": labels.get(c.tensor, c.tensor)}})
    return events


@register_view("chrome_trace")
def write_chrome_trace(plan, path) -> None:
    from pathlib import Path
    Path(path).write_text(json.dumps(chrome_trace(plan)))
