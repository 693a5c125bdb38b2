"""What a person sees while torchalpa works: progress lines, log levels, the plan cache."""

import io
import json
import logging
import multiprocessing
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import torchalpa
from torchalpa.core import progress
from torchalpa.parallel import cache


def test_plan_reports_capture_and_each_mesh(caplog, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHALPA_CACHE_DIR", str(tmp_path))
    caplog.set_level(logging.INFO, logger="torchalpa")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
        x, y = torch.empty(8, 32), torch.empty(8, 32)
    method = torchalpa.ShardParallel(logical_mesh_shape=(2,))
    torchalpa.plan(model, (x, y), F.mse_loss, method=method,
                   cluster=torchalpa.Cluster.local_cpu(2))
    text = caplog.text
    assert "capturing the training step: " in text and "4 parameters" in text
    assert "mesh 1/1 (2) solving: " in text and "ms/step" in text
    # the second time the plan comes from the cache, and says so
    caplog.clear()
    torchalpa.plan(model, (x, y), F.mse_loss, method=method,
                   cluster=torchalpa.Cluster.local_cpu(2))
    assert "mesh 1/1 (2) solving: " in caplog.text and "cached" in caplog.text


def test_log_level_from_environment(monkeypatch):
    monkeypatch.setenv("TORCHALPA_LOG", "warning")
    progress.setup_logging()
    assert not progress.log.isEnabledFor(logging.INFO)
    monkeypatch.setenv("TORCHALPA_LOG", "debug")
    progress.setup_logging()
    assert progress.log.isEnabledFor(logging.DEBUG)
    monkeypatch.setenv("TORCHALPA_LOG", "loud")
    with pytest.raises(ValueError, match="TORCHALPA_LOG must be one of"):
        progress.setup_logging()
    monkeypatch.setenv("TORCHALPA_LOG", "info")
    progress.setup_logging()


def test_step_logs_failure(caplog):
    caplog.set_level(logging.INFO, logger="torchalpa")
    with pytest.raises(RuntimeError):
        with progress.step("solving"):
            raise RuntimeError("boom")
    assert "solving: failed after" in caplog.text and "boom" in caplog.text


def _plan_file(root, key, size, mtime):
    path = root / f"{key}.json"
    path.write_text(json.dumps({"version": 1, "mesh": {"shape": [2, 4]},
                                "method": {"name": "ShardParallel"},
                                "estimates": {"step_time_s": 0.012}, "pad": "x" * size}))
    import os
    os.utime(path, (mtime, mtime))
    return path


def test_cache_list_trim_clear(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHALPA_CACHE_DIR", str(tmp_path))
    for i in range(4):
        _plan_file(tmp_path, f"k{i}", 1000, 1_000_000 + i)
    listed = cache.entries()
    assert [e.key for e in listed] == ["k3", "k2", "k1", "k0"]          # newest first
    assert listed[0].description == "ShardParallel mesh 2x4, est 12 ms/step"
    assert cache.trim(limit=2500) == 2                                   # the two oldest go
    assert [e.key for e in cache.entries()] == ["k3", "k2"]
    assert cache.clear()[0] == 2 and cache.entries() == []
    monkeypatch.setenv("TORCHALPA_CACHE_MAX_MB", "lots")
    with pytest.raises(ValueError, match="TORCHALPA_CACHE_MAX_MB"):
        cache.max_bytes()


class _SlowStream(io.TextIOBase):
    """A stream whose writes hold its own lock a while, as a buffered file's do (a full
    pipe, a slow terminal): a process forked mid-write inherits the lock held."""

    lock = threading.Lock()

    def write(self, s):
        with self.lock:
            time.sleep(0.002)
        return len(s)


def _child_logs():
    progress.log.info("a forked solver says hello")


def test_a_process_forked_while_a_heartbeat_writes_can_still_log(monkeypatch):
    """The search forks solver processes inside a step whose heartbeat thread logs; a
    child forked in the middle of a heartbeat's write used to wait forever on the
    stream's lock at its first log line (24 of 30 children here before the fork guard)."""
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.0002)
    handler = logging.StreamHandler(_SlowStream())
    monkeypatch.setattr(progress.log, "level", logging.INFO)
    progress.log.addHandler(handler)
    hung = 0
    try:
        with progress.step("forking solvers"):
            time.sleep(0.01)
            for _ in range(12):
                child = multiprocessing.get_context("fork").Process(target=_child_logs)
                child.start()
                child.join(10)
                if child.is_alive():
                    hung += 1
                    child.kill()
    finally:
        progress.log.removeHandler(handler)
    assert hung == 0


def _sleep(seconds):
    time.sleep(seconds)
    return seconds


def _in_a_fresh_interpreter(test: str) -> None:
    """Run one test of this file in a new Python process (nothing else imported there),
    failing here with its output if it fails there."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "no:xdist", f"{__file__}::{test}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + \
        proc.stderr[-2000:]


def test_a_step_waiting_on_a_worker_pool_still_speaks_and_counts(caplog, monkeypatch):
    """The search waits on forked workers (``fork_map``, ``StageJobs``) inside a step:
    its heartbeat, on a thread of its own, still logs, saying how many are done."""
    from torchalpa.passes.pipeline_search.stage_jobs import StageJobs, can_fork, fork_map
    if not can_fork():      # JAX loaded by another test of this process: the pool would
        _in_a_fresh_interpreter("test_a_step_waiting_on_a_worker_pool_still_speaks_and_counts")
        return              # run its jobs here, so run this test where it forks
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.05)
    caplog.set_level(logging.INFO, logger="torchalpa")
    with progress.step("waiting on the pool"):
        assert fork_map(_sleep, [0.4, 0.4, 0.4], 2, unit="views") == [0.4, 0.4, 0.4]
    text = caplog.text
    assert text.count("waiting on the pool: still working") >= 2
    assert "of 3 views done, in 2 processes" in text
    caplog.clear()
    jobs = StageJobs(_sleep, workers=2)
    with progress.step("waiting on stage solves"):
        assert jobs.solve([("a", 0.4), ("b", 0.4), ("c", 0.4)]) == [0.4, 0.4, 0.4]
    jobs.close()
    assert caplog.text.count("waiting on stage solves: still working") >= 2
    assert "of 3 stage solves of this round done" in caplog.text


def test_only_the_innermost_step_speaks_and_says_what_is_left(caplog, monkeypatch):
    monkeypatch.setattr(progress, "HEARTBEAT_S", 0.05)
    caplog.set_level(logging.INFO, logger="torchalpa")
    with progress.step("outer"):
        progress.left("phase 1/2")
        with progress.step("inner"):
            progress.left("3 of 4 done")
            time.sleep(0.3)
        time.sleep(0.3)
    text = caplog.text
    assert "inner: still working" in text and "; 3 of 4 done" in text
    assert "outer: still working" in text and "; phase 1/2" in text
    inner_end = text.index("inner: 0.")
    assert "outer: still working" not in text[:inner_end]      # quiet while inner ran


def test_a_failed_step_logs_the_first_line_of_its_error(caplog):
    caplog.set_level(logging.INFO, logger="torchalpa")
    with pytest.raises(ValueError):
        with progress.step("planning"):
            raise ValueError("nothing fits\n  tried: a\n  tried: b")
    assert "planning: failed after" in caplog.text and "nothing fits (...)" in caplog.text
    assert "tried: a" not in caplog.text
