"""Real ranks SIGKILLed (tests/fault_worker.py, plain launches: no torchrun agent stops the
survivors): the survivors name exactly the dead rank, and a save killed at any point
leaves the previous checkpoint complete and loadable; a damaged shard (no rank dies) on the
rank pool.

One 3-rank kill runs in ``make test``; the others are ``slow``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import worker_io
from fault_worker import batch, build

import torchalpa
from torchalpa.runtime.state.checkpoint import load_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(out, world: int, *args, exits: dict | None = None,
            port: int | None = None) -> dict[int, dict]:
    """Launch ``world`` ranks of fault_worker.py; what each survivor wrote, by rank. Each
    process's exit status, stderr and end (``time.time()``) go into ``exits`` if given."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port or _free_port()),
               WORLD_SIZE=str(world), OMP_NUM_THREADS="1", TORCHALPA_TIMEOUT_S=str(TIMEOUT_S))
    logs = [open(out / f"stderr{r}.txt", "w+") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "fault_worker.py"), str(out),
                               *map(str, args)], env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.DEVNULL, stderr=logs[r], text=True)
             for r in range(world)]
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 480          # a loaded machine: allow for slow starts
    while len(ended) < world and time.monotonic() < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.time()
        time.sleep(0.1)
    for r, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
        p.wait()
        logs[r].seek(0)
        if exits is not None:
            exits[r] = {"code": p.returncode, "stderr": logs[r].read(), "ended_at": ended.get(r)}
        logs[r].close()
    seen = {}
    for r in range(world):
        path = out / f"rank{r}.json"
        if path.exists():
            seen[r] = json.loads(path.read_text())
    assert seen, "no rank reported:\n" + "\n".join(
        (out / f"stderr{r}.txt").read_text()[-3000:] for r in range(world))
    return seen


def blamed(message: str) -> set[int]:
    """The ranks a survivor's error names as dead, failed or not responding."""
    ranks = set()
    for m in re.finditer(r"rank\(s\) ([\d, ]+) (?:died|did not respond|are stuck)", message):
        ranks |= {int(r) for r in m.group(1).split(",")}
    ranks |= {int(r) for r in re.findall(r"rank (\d+) failed with", message)}
    return ranks


def check_survivors_name(seen: dict, victim: int, world: int) -> None:
    survivors = [r for r in range(world) if r != victim]
    assert sorted(seen) == survivors, f"expected reports from {survivors}, got {sorted(seen)}"
    for r, s in seen.items():
        assert s["error"], f"rank {r} did not notice rank {victim}'s death"
        if victim == 0:       # rank 0 hosts the store: that is all a survivor can tell
            assert "store is unreachable" in s["error"] or "Connection" in s["error"], s["error"]
        else:
            assert "RankFailedError" in s["error"], s["error"]
            assert blamed(s["error"]) == {victim}, f"rank {r}: {s['error']}"
            assert s["seconds"] < TIMEOUT_S + 20


def load_weights(path) -> list[torch.Tensor]:
    """The checkpoint under ``path`` loaded into a fresh model in this process (one rank)."""
    torch.manual_seed(1)
    pm = torchalpa.auto_parallel(build(), batch(), F.mse_loss,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                 method=torchalpa.ShardParallel())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")      # saved by more ranks: random state not restored
            load_checkpoint(path, pm)
        return [p.full_tensor().clone() for p in pm.parameters()]
    finally:
        dist.destroy_process_group()


def check_save_killed(tmp_path, world: int, victim: int, point: str, loads: str) -> None:
    seen = run_job(tmp_path, world, "save", victim, point)
    if point != "before_prune":       # the save had not committed: every survivor is told
        check_survivors_name(seen, victim, world)
    want = torch.load(tmp_path / "weights.pt", weights_only=True)[loads]
    got = load_weights(tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(got, want)), f"did not load the {loads} weights"


def test_a_rank_killed_mid_save_is_named_and_the_previous_checkpoint_loads(tmp_path):
    check_save_killed(tmp_path, 3, 2, "data_written", "old")


@pytest.mark.slow
@pytest.mark.parametrize("victim,point,loads", [
    (1, "started", "old"), (0, "data_written", "old"), (0, "before_manifest", "old"),
    (0, "before_rename", "old"), (0, "before_latest", "old"), (0, "before_prune", "new")])
def test_a_save_killed_at_each_point(tmp_path, victim, point, loads):
    check_save_killed(tmp_path, 2, victim, point, loads)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 2, 3])
def test_a_rank_killed_between_steps_is_the_only_one_named(tmp_path, victim):
    check_survivors_name(run_job(tmp_path, 4, "step", victim), victim, 4)


def test_under_torchrun_the_survivors_name_the_dead_rank_before_the_agent_stops_them(tmp_path):
    """torchrun's agent SIGTERMs the survivors as soon as rank 2 is SIGKILLed; each still
    ends with an error naming exactly rank 2 (the collective timeout is set far longer
    than the test may take, so it is the SIGTERM path that speaks, not a timeout)."""
    world, victim, collective_timeout_s = 4, 2, 600   # 4: the step has collectives
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHALPA_TIMEOUT_S=str(collective_timeout_s))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", "--monitor-interval=0.2",
           os.path.join(HERE, "fault_worker.py"), str(tmp_path), "step", str(victim)]
    start = time.monotonic()
    job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    seconds = time.monotonic() - start
    output = job.stdout + job.stderr
    assert job.returncode != 0, output[-3000:]
    said: dict[int, str] = {}
    for m in re.finditer(r"RankFailedError: (rank (\d+): torchrun stopped the job.*)", output):
        said[int(m.group(2))] = m.group(1)
    for r in range(world):                 # or caught by the script, which wrote it down
        path = tmp_path / f"rank{r}.json"
        if path.exists() and json.loads(path.read_text())["error"]:
            seen = json.loads(path.read_text())
            said.setdefault(r, seen["error"])
            assert seen["seconds"] < 60, f"rank {r} took {seen['seconds']:.0f} s to stop"
    assert sorted(said) == [0, 1, 3], output[-3000:]
    for r, message in said.items():
        assert blamed(message) == {victim}, f"rank {r}: {message}"
    assert seconds < 240 < collective_timeout_s, f"the job took {seconds:.0f} s to stop"


def test_a_flipped_byte_in_one_ranks_shard_stops_every_rank_and_fallback_loads_the_previous(
        tmp_path):
    """Each rank checks a share of the files: the damage is found by one and told to all.
    (No rank dies: on the rank pool.)"""
    ranks = worker_io.launch("fault_worker.py", tmp_path / "flip.json", "flip", -1,
                             nproc=2)["ranks"]
    seen = dict(enumerate(ranks))
    assert sorted(seen) == [0, 1] and [s["rank"] for s in ranks] == [0, 1]
    for r, s in seen.items():
        assert s["error"] is None, f"rank {r}: {s['error']}"
        assert re.search(r"ckpt-000002 is damaged: __1_0\.distcp does not match its checksum"
                         r".*ckpt-000001 is intact", s["refused"] or ""), f"rank {r}: {s}"
        assert s["loaded"] == "ckpt-000001" and s["old_weights"], f"rank {r}: {s}"
        assert any("__1_0.distcp does not match" in w for w in s["warned"]), f"rank {r}: {s}"


def test_a_bad_file_of_the_last_rank_is_refused_on_every_rank_and_changes_nothing(tmp_path):
    """4 ranks, ZeRO-3 and Adam: rank 3's random state, an optimizer item of its shard, or
    its whole shard is bad (the manifest rewritten to match, so only reading finds it), or
    rank 3's first layer refuses the extra state saved for it (``set_extra_state``).
    Every rank refuses the load naming the file, and no rank's parameters, optimizer
    state, random state or step counter changed, even one whose optimizer had no state
    yet; the good checkpoint then loads bit-identically (tests/load_refusal_worker.py)."""
    ranks = worker_io.launch("load_refusal_worker.py", tmp_path / "refusal.json",
                             nproc=4)["ranks"]
    damaged = {"rng": "rng-3.pt", "optimizer": "__3_0.distcp", "shard": "__3_0.distcp",
               "fresh optimizer": "__3_0.distcp"}
    for r, seen in enumerate(ranks):
        for kind, name in damaged.items():
            found = seen[kind]
            assert "trace" not in found, f"rank {r}, {kind}: {found}"
            assert re.search(rf"ckpt-000001 cannot be loaded: .*rank 3: [^;]*{re.escape(name)}"
                             r".*Nothing was loaded", found["error"] or ""), \
                f"rank {r}, {kind}: {found['error']}"
            assert found["changed"] == [], f"rank {r}, {kind}: a refused load changed these"
        extra = seen["extra state"]
        assert "trace" not in extra, f"rank {r}: {extra}"
        assert re.search(r"ckpt-000001 cannot be loaded: rank 3: module '0' \(Versioned\) "
                         r"refused its saved extra state.*reads formats up to 1.*Nothing was "
                         r"loaded", extra["error"] or ""), f"rank {r}: {extra['error']}"
        assert extra["changed"] == [] and extra["scale"] == 5.0, f"rank {r}: {extra}"
        # the step counter counts this process's calls: it is not in a checkpoint
        assert seen["good"]["changed"] == ["step counter"], f"rank {r}: {seen['good']}"


@pytest.mark.slow     # hang: 56 s at load 18, mostly 4 ranks starting (the heartbeat alone: test_rank_watchdog)
@pytest.mark.parametrize("mode", ["hang", "stuck"])
def test_a_hung_rank_is_stopped_once_the_others_have_failed(tmp_path, mode):
    """A plain launch (no torchrun agent): rank 1 never reaches its second step -- asleep
    (``hang``), or blocked in a receive nobody sends on a group with an hour's timeout
    (``stuck``). The others fail after the collective timeout naming it; then its own
    heartbeat ends its process, exit status 1, saying why and where it was stuck."""
    world, victim = 4, 1          # 4: the step has collectives (on 3 ranks, this plan none)
    exits: dict = {}
    seen = run_job(tmp_path, world, mode, victim, exits=exits)
    survivors = [r for r in range(world) if r != victim]
    assert sorted(seen) == survivors, f"reports from {sorted(seen)}: {exits}"
    for r in survivors:
        assert blamed(seen[r]["error"] or "") == {victim}, f"rank {r}: {seen[r]['error']}"
        assert "did not respond" in seen[r]["error"]
    stopped = exits[victim]
    assert stopped["ended_at"] is not None, f"rank {victim} was never stopped"
    assert stopped["code"] == 1, stopped
    said = stopped["stderr"]
    assert f"rank {victim}: stopped by torchalpa: the job failed" in said, said[-3000:]
    assert f"rank(s) {victim} did not respond" in said, said[-3000:]
    assert ("time.sleep(3600)" if mode == "hang" else "dist.recv(") in said, said[-3000:]
    failed_at = max(seen[r]["ended_at"] for r in survivors)
    assert stopped["ended_at"] - failed_at < 15, \
        f"rank {victim} ended {stopped['ended_at'] - failed_at:.1f} s after the others failed"


def _watchdogs(port: int) -> list[str]:
    """The command lines of the running watchdog processes of the job on ``port``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if any(a.endswith("rank_watchdog.py") for a in argv) and str(port) in argv \
                and state not in ("Z", "X"):
            found.append(" ".join(argv))
    return found


@pytest.mark.slow             # 4 ranks' start: 73 s at load 32 (the watchdog alone: test_rank_watchdog)
def test_a_rank_stuck_in_c_holding_the_gil_is_stopped_from_outside(tmp_path):
    """A plain launch: rank 1 sleeps in C holding the GIL (no thread of its interpreter
    runs, its heartbeat's neither) and rank 2 raises out of its script. The others fail
    naming rank 2's error and rank 1 as stuck (its process is alive: not "died"); rank 1's
    watchdog process prints where it was and ends it, well within 60 s of rank 2's
    error, and no process of the job is left."""
    world, victim, raiser = 4, 1, 2
    port = _free_port()
    exits: dict = {}
    seen = run_job(tmp_path, world, "cstuck", victim, exits=exits, port=port)
    survivors = [0, 3]
    assert sorted(seen) == survivors, f"reports from {sorted(seen)}: {exits}"
    for r in survivors:
        said = seen[r]["error"] or ""
        assert f"rank {raiser} failed with ValueError: rank {raiser} gave up" in said, said
        assert f"rank(s) {victim} are stuck (alive" in said and "died" not in said, said
    assert exits[raiser]["code"] == 1, exits[raiser]
    stopped = exits[victim]
    assert stopped["ended_at"] is not None, f"rank {victim} was never stopped"
    assert stopped["code"] in (-signal.SIGTERM, -signal.SIGKILL), stopped
    said = stopped["stderr"]
    assert f"rank {victim}: stopped by torchalpa: the job failed" in said, said[-3000:]
    assert "no Python ran for" in said and "in stuck_in_c" in said, said[-3000:]
    took = stopped["ended_at"] - exits[raiser]["ended_at"]
    assert took < 60, f"rank {victim} ended {took:.1f} s after rank {raiser} raised"
    deadline = time.monotonic() + 5            # a watchdog ends within a poll of its rank
    while _watchdogs(port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _watchdogs(port) == []
