"""``torchalpa bench``: automatic plan vs DDP vs FSDP2 under torchrun, one table."""

from __future__ import annotations

import json
import re

import pytest

from torchalpa.cli.bench import table_rows
from torchalpa.cli.commands import main


def _result(loopback_exact: bool) -> dict:
    def stats(step_s, loopback, collective=None):
        s = {"step_s": step_s, "loopback_bytes_per_step": loopback, "peak_bytes": 300 * 2**20}
        if collective is not None:
            s["collective_bytes_per_step"] = collective
        return s
    return {"model": "m", "num_params": 1000, "world_size": 2, "backend": "gloo", "steps": 2,
            "loopback_exact": loopback_exact,
            "stats": {"torchalpa": stats(0.03, 2**20, collective=2**19),
                      "ddp": stats(0.02, 2**21), "fsdp2": stats(0.04, 2**22)}}


def test_rows_give_ratios_to_the_faster_baseline_and_bytes_only_where_measured():
    rows = table_rows(_result(loopback_exact=True))
    assert rows == [("torchalpa", "30.0", "1.50", "1.000", "300"),
                    ("ddp", "20.0", "1.00", "2.000", "300"),
                    ("fsdp2", "40.0", "2.00", "4.000", "300")]
    # outside a private network namespace loopback bytes are not the job's own: only what
    # torchalpa's collectives were handed is shown
    assert [r[3] for r in table_rows(_result(loopback_exact=False))] == ["0.500", "-", "-"]


def test_bench_rejects_an_unknown_model_before_starting_torchrun(capsys):
    assert main(["bench", "no_such_family", "--nproc", "2"]) == 2
    assert "unknown model 'no_such_family'" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_runs_the_three_methods_under_torchrun(capsys, tmp_path):
    """2 gloo ranks, 2 steps of the zoo's tiny GPT under each method (about 100 s on two
    loaded cores: three torchrun ranks' imports and torchalpa's planning)."""
    out = tmp_path / "bench.json"
    assert main(["bench", "gpt", "--nproc", "2", "--steps", "2", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = {m: re.search(rf"{m}\s*│\s*([\d.]+)\s*│\s*([\d.]+)\s*│\s*([\d.-]+)\s*│\s*(\d+)",
                         printed) for m in ("torchalpa", "ddp", "fsdp2")}
    assert all(rows.values()), printed
    for match in rows.values():
        assert float(match.group(1)) > 0 and int(match.group(4)) > 0
    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and set(result["stats"]) == {"torchalpa", "ddp", "fsdp2"}
    assert "mesh [2]" in result["stats"]["torchalpa"]["plan"]
    # torchalpa's sent bytes are measured either way (loopback, or its collectives)
    assert float(rows["torchalpa"].group(3)) > 0
