"""Which plans a cost-model change moved: two runs of weak_scaling.py, search_39b.py and
expert_plans.py (before and after), side by side.

    python benchmarks/compare_plans.py --before DIR_A --after DIR_B

Each directory holds the scripts' printed output as ``weak.txt``, ``search39b.txt`` and
``expert.txt`` (any missing file is skipped; rows missing from one side are listed as
such). Printed per row: the estimated step before and after, after / before, and whether
the chosen plan changed (weak scaling and the 39B search print the plan: stages, submeshes,
logical meshes, remat; expert_plans prints only estimates and which hand-written layout
was best, so there a change of the best layout is reported).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

WEAK_ROW = re.compile(r"^\s*(\S+)\s+(\d+) \| auto\s+(\S+) ms .*?\| best grid\s+(\S+) ms .*?"
                      r"\((.*?)\) \| auto/grid")
WEAK_PLAN = re.compile(r"^\s+auto: (.*)$")
SEARCH = re.compile(r"auto: search wall .*?; (stages .*?); est step (\S+) s")
EXPERT = re.compile(r"^\s*(\S+) on\s+(\d+): auto (\S+)\s+\|(.*)\|\s+best hand (\S+)")


def weak_scaling(text: str) -> dict[str, tuple[float, str]]:
    """row -> (auto's estimated step in ms, its plan and the best grid)."""
    rows, last = {}, None
    for line in text.splitlines():
        m = WEAK_ROW.match(line)
        if m:
            last = f"weak {m.group(1)} on {m.group(2)}"
            rows[last] = (_ms(m.group(3)), f"best grid {m.group(5)} {m.group(4)} ms")
            continue
        p = WEAK_PLAN.match(line)
        if p and last is not None:
            rows[last] = (rows[last][0], f"{p.group(1)}; {rows[last][1]}")
            last = None
    return rows


def search_39b(text: str) -> dict[str, tuple[float, str]]:
    m = SEARCH.search(text)
    return {"GPT-39B search 8x8": (float(m.group(2)) * 1e3, m.group(1))} if m else {}


def expert_plans(text: str) -> dict[str, tuple[float, str]]:
    rows = {}
    for line in text.splitlines():
        m = EXPERT.match(line)
        if m:
            key = f"expert {m.group(1)} on {m.group(2)}"
            rows[f"{key}: auto"] = (_ms(m.group(3)), f"best hand {m.group(5)}")
            for label, ms in re.findall(r"(\S+) (\d+|OOM)", m.group(4)):
                rows[f"{key}: {label}"] = (_ms(ms), "")
    return rows


def _ms(text: str) -> float:
    return float("inf") if text == "OOM" else float(text)


READERS = {"weak.txt": weak_scaling, "search39b.txt": search_39b, "expert.txt": expert_plans}


def compare(before: dict, after: dict) -> list[str]:
    lines = []
    for key in list(before) + [k for k in after if k not in before]:
        if key not in after or key not in before:
            lines.append(f"{key:<34} only {'before' if key in before else 'after'}")
            continue
        (b, plan_b), (a, plan_a) = before[key], after[key]
        ratio = "-" if b in (0, float("inf")) or a == float("inf") else f"{a / b:.3f}"
        changed = "plan changed" if plan_a != plan_b else ("same plan" if plan_a else "")
        lines.append(f"{key:<34}{_fmt(b):>10}{_fmt(a):>10}{ratio:>8}  {changed}")
        if plan_a != plan_b:
            lines.append(f"{'':<36}before: {plan_b}\n{'':<36}after:  {plan_a}")
    return lines


def _fmt(ms: float) -> str:
    return "OOM" if ms == float("inf") else f"{ms:.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, type=Path)
    p.add_argument("--after", required=True, type=Path)
    args = p.parse_args()
    print(f"{'estimate (ms)':<34}{'before':>10}{'after':>10}{'a/b':>8}")
    for name, read in READERS.items():
        paths = args.before / name, args.after / name
        if not all(path.is_file() for path in paths):
            print(f"({name}: not in both directories, skipped)")
            continue
        for line in compare(read(paths[0].read_text()), read(paths[1].read_text())):
            print(line)


if __name__ == "__main__":
    main()
