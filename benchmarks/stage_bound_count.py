"""Does the stage DP's LP bound (``PassSwitches.stage_bounds``) fire, and what does it cost?

    OMP_NUM_THREADS=1 TORCHALPA_CACHE=0 python benchmarks/stage_bound_count.py --rows 1.3b 2.6b
    OMP_NUM_THREADS=1 TORCHALPA_CACHE=0 python benchmarks/stage_bound_count.py \
        --pytest tests/test_stages.py tests/test_stage_remat.py -m "not slow"

Counts, in this process, the stage variants each DP round asks for
(``StageSearch._cut_by_bounds``' picks), the LP bounds it takes (``ExactStages.lower_bound``,
with their CPU seconds) and the variants it leaves unsolved. ``--rows``: the weak-scaling
rows' automatic searches as ``search_ab.py --workers 1`` plans them, one line per row.
``--pytest``: the arguments given to pytest, one line per test that priced a stage
variant or took a bound, then the totals. The rule is on in both (its default).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

from torchalpa.passes.pipeline_search import exact_stages, stage_search


@dataclass
class Counts:
    """What the rule did since the last ``clear``."""

    picks: int = 0
    bounds: int = 0
    bound_cpu_s: float = 0.0
    cut: int = 0

    def clear(self) -> None:
        self.picks = self.bounds = self.cut = 0
        self.bound_cpu_s = 0.0

    def __str__(self) -> str:
        return (f"{self.picks} variants picked, {self.bounds} LP bounds "
                f"({self.bound_cpu_s:.1f} s CPU), {self.cut} cut")


def counting() -> Counts:
    """Wrap the rule's two calls so that they count into the returned record."""
    counts = Counts()
    lower_bound = exact_stages.ExactStages.lower_bound
    cut_by_bounds = stage_search.StageSearch._cut_by_bounds

    def counted_bound(self, *args, **kwargs):
        start = time.process_time()
        try:
            return lower_bound(self, *args, **kwargs)
        finally:
            counts.bounds += 1
            counts.bound_cpu_s += time.process_time() - start

    def counted_cut(self, picks):
        kept = cut_by_bounds(self, picks)
        counts.picks += len(picks)
        counts.cut += len(picks) - len(kept)
        return kept

    exact_stages.ExactStages.lower_bound = counted_bound
    stage_search.StageSearch._cut_by_bounds = counted_cut
    return counts


class _PerTest:
    """A pytest plugin keeping ``counts`` per test that priced a variant or took a bound
    (``lines``: printed after pytest, which captures what its hooks print)."""

    def __init__(self, counts: Counts):
        self.counts, self.total, self.lines = counts, Counts(), []

    def pytest_runtest_setup(self, item):
        self.counts.clear()

    def pytest_runtest_teardown(self, item):
        c = self.counts
        if c.picks or c.bounds:
            self.lines.append(f"{item.nodeid}: {c}")
            self.total.picks += c.picks
            self.total.bounds += c.bounds
            self.total.bound_cpu_s += c.bound_cpu_s
            self.total.cut += c.cut


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", nargs="*", default=[], help="weak-scaling rows (search_ab.py)")
    p.add_argument("--pytest", nargs=argparse.REMAINDER, default=None,
                   help="the rest of the command line, given to pytest")
    args = p.parse_args()
    counts = counting()
    for row in args.rows:
        import search_ab
        counts.clear()
        sys.argv = ["search_ab.py", "--row", row, "--workers", "1"]
        start = time.process_time()
        search_ab.main()
        print(f"row {row}: {counts}; the search {time.process_time() - start:.1f} s CPU",
              flush=True)
    if args.pytest is not None:
        import pytest
        plugin = _PerTest(counts)
        code = pytest.main(["-p", "no:cacheprovider", "-q", *args.pytest], plugins=[plugin])
        print("\n".join(plugin.lines))
        print(f"tests: {plugin.total} (pytest exit {int(code)})")


if __name__ == "__main__":
    main()
