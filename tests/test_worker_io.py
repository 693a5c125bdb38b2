"""The multi-rank tests' launcher (tests/worker_io.py): the rank pool reuses its processes
across launches, exchanges real data between them, and a job that fails shows its trace
and leaves the next launch a fresh pool. (``real=True``, under torchrun, is what
tests/test_distributed.py's two-rank launch and tests/test_pipeline.py's eight take.)"""

from __future__ import annotations

import time

import pytest
import worker_io


def test_pool_reuses_its_ranks_and_exchanges_real_data(tmp_path):
    first = worker_io.launch("probe_worker.py", tmp_path / "a.json", -1, nproc=2)
    second = worker_io.launch("probe_worker.py", tmp_path / "b.json", -1, nproc=2)
    assert first["rank_sum"] == 1.0 and first["world_size"] == 2
    assert len(set(first["pids"])) == 2              # two processes,
    assert second["pids"] == first["pids"]           # started once


def test_a_failed_job_shows_its_trace_and_the_next_gets_a_fresh_pool(tmp_path):
    before = worker_io.launch("probe_worker.py", tmp_path / "a.json", -1, nproc=2)
    with pytest.raises(AssertionError, match="probe failure on rank 1"):
        worker_io.launch("probe_worker.py", tmp_path / "b.json", 1, nproc=2, timeout=60)
    after = worker_io.launch("probe_worker.py", tmp_path / "c.json", -1, nproc=2)
    assert after["rank_sum"] == 1.0
    assert set(after["pids"]).isdisjoint(before["pids"])



def test_a_scenario_that_raises_on_one_rank_stops_every_rank_with_its_trace(tmp_path):
    # rank 1 raises inside a scenario while rank 0 waits for it in an all-reduce: the job
    # must stop in seconds (not at the pool's timeout) and show rank 1's own trace first
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        worker_io.launch("probe_worker.py", tmp_path / "a.json", 1, "scenario", nproc=2,
                         timeout=120)
    assert time.monotonic() - start < 30            # probe_worker waits 3 s, then stops
    message = str(failed.value)
    assert "--- rank 1 (failed first) ---" in message
    first = message.split("--- rank 1 (failed first) ---")[1]
    assert "probe failure in a scenario on rank 1" in first
    assert "ScenarioDivergedError" in first and "rank(s) [0] were still inside it" in first
    # (the next launch gets a fresh pool: the test above)


def test_a_checked_launch_fails_the_test_with_a_recorded_scenarios_trace(tmp_path):
    # every rank raises alike in each scenario: the job finishes, the errors are recorded
    out = tmp_path / "a.json"
    with pytest.raises(pytest.fail.Exception, match="(?s)scenario first failed.*probe failure"):
        worker_io.launch_checked("probe_worker.py", out, -2, "scenario", nproc=2)
    results = worker_io.launch("probe_worker.py", tmp_path / "b.json", -2, "scenario", nproc=2)
    with pytest.raises(pytest.fail.Exception, match="(?s)scenario second failed.*Traceback"):
        worker_io.scenario(results, "second")
