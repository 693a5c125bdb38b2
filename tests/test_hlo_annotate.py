"""A StableHLO step annotated with its plan (torchalpa/interop/hlo_annotate.py): Shardy and GSPMD
spellings, and XLA partitioning an annotated step into the plan's collectives."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax", reason="jax/jaxlib are not installed: "
                                  "pip install 'torchalpa[stablehlo]'")

from torchalpa.core.placement import Partial, Replicate, Shard  # noqa: E402
from torchalpa.interop.hlo_annotate import sdy_sharding  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("placements,rank,expected", [
    ((Shard(0), Replicate()), 2, '#sdy.sharding<@mesh, [{"dp"}, {}]>'),
    ((Replicate(), Shard(1)), 2, '#sdy.sharding<@mesh, [{}, {"tp"}]>'),
    ((Shard(0), Shard(0)), 3, '#sdy.sharding<@mesh, [{"dp", "tp"}, {}, {}]>'),
    ((Replicate(), Replicate()), 0, "#sdy.sharding<@mesh, []>")])
def test_shardy_sharding_strings(placements, rank, expected):
    assert sdy_sharding(placements, rank, ("dp", "tp")) == expected


def test_a_partial_sum_has_no_shardy_sharding():
    with pytest.raises(ValueError, match="Partial"):
        sdy_sharding((Partial("sum"),), 2, ("dp",))


@pytest.mark.slow
def test_xla_partitions_an_annotated_step_into_the_plans_collectives(tmp_path):
    """An MLP whose plan shards w1 by columns and w2 by rows reshards between ops (the
    partial sum after w2 is reduced before tanh). Annotated in either dialect (arguments,
    results and a constraint at every resharding point), XLA's compiled program issues the
    plan's collectives: the same kinds, tensors and bytes (merged ones counted as merged)."""
    out = tmp_path / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "hlo_annotate_worker.py"),
                           str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["intermediate_reshards"] >= 1
    planned = sorted((c["kind"], c["bytes"]) for c in report["plan"])
    for dialect in ("mhlo", "sdy"):
        got = report[dialect]
        assert len(got["constraints"]) == report["intermediate_reshards"], got
        assert not got["skipped"], got["skipped"]
        xla = got["xla"]
        assert {c["kind"] for c in xla} == {k for k, _ in planned}, (dialect, xla, planned)
        assert sum(c["tensors"] for c in xla) == len(planned), (dialect, xla, planned)
        assert sum(c["bytes"] for c in xla) == sum(b for _, b in planned), (dialect, xla)
