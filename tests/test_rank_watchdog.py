"""A rank's watchdog process (runtime/resilience/rank_watchdog.py) on its own, without a job: a
stand-in rank that starts it and then sleeps in C holding the GIL (so no beat ever comes)
is stopped once the store says the job failed and the other rank left; one that leaves
("q") ends its watchdog. The whole job is tests/test_faults_dist.py's stuck-in-C test.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time

import torch.distributed as dist
from test_faults_dist import _free_port

import torchalpa.runtime.resilience

WATCHDOG = os.path.join(os.path.dirname(torchalpa.runtime.resilience.__file__), "rank_watchdog.py")

# the stand-in for rank 1 of 2: starts its watchdog, says where it is, then either leaves
# at once, ends after 4 s without a word, or sleeps in C holding the GIL (ctypes.PyDLL
# keeps it during the call)
RANK = """
import ctypes, faulthandler, signal, subprocess, sys
port, mode = sys.argv[1], sys.argv[2]
faulthandler.register(signal.SIGUSR2, all_threads=True)
dog = subprocess.Popen([sys.executable, sys.argv[3], "127.0.0.1", port, "1", "2",
                        str(__import__("os").getpid())], stdin=subprocess.PIPE)
print(dog.pid, flush=True)
if mode == "leave":
    dog.stdin.write(b"q"); dog.stdin.flush(); dog.wait(30); sys.exit(0)
if mode == "gone":   # silent, then gone without a word, its job's store never there
    __import__("time").sleep(4); sys.exit(0)
libc = ctypes.PyDLL(None)
while True:
    libc.sleep(120)   # the stack dump's signal ends one call
"""


def _store(port: int):
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _start(port: int, mode: str):
    rank = subprocess.Popen([sys.executable, "-c", RANK, str(port), mode, WATCHDOG],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert rank.stdout is not None
    return rank, int(rank.stdout.readline())


def test_a_silent_rank_is_stopped_once_the_job_failed_and_the_others_left():
    port = _free_port()
    store = _store(port)
    store.set("torchalpa/job_failed", "rank 0: step 2 stopped because rank 0 gave up")
    store.set("torchalpa/left/0", "stopped")
    began = time.monotonic()
    rank, dog = _start(port, "sleep")
    try:
        code = rank.wait(timeout=60)
    finally:
        if rank.poll() is None:
            rank.kill()
        said = rank.communicate()[1]
    assert code in (-signal.SIGTERM, -signal.SIGKILL), (code, said[-2000:])
    assert "RankFailedError: rank 1: stopped by torchalpa: the job failed (rank 0: step 2 " \
           "stopped because rank 0 gave up); this rank was stuck where no Python ran" in said
    assert 'File "<string>", line 14 in <module>' in said, said[-2000:]   # at libc.sleep
    assert store.get("torchalpa/left/1").decode() == "stopped: stuck after the job failed"
    assert store.check(["torchalpa/stuck/1"])
    assert time.monotonic() - began < 60
    deadline = time.monotonic() + 5
    while _alive(dog) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(dog), "the watchdog outlived its rank"


def test_a_rank_that_leaves_ends_its_watchdog_and_is_not_stopped():
    port = _free_port()
    store = _store(port)
    store.set("torchalpa/job_failed", "rank 0 gave up")
    rank, dog = _start(port, "leave")
    assert rank.wait(timeout=60) == 0, rank.communicate()[1][-2000:]
    assert not _alive(dog)
    assert not store.check(["torchalpa/stuck/1"])


def test_a_watchdog_whose_store_is_gone_says_nothing():
    """A rank silent long enough for its watchdog to reach for the job's store, which is
    gone (a rank slow to tear down under load, after its job ended): the watchdog gives
    up quietly when its rank leaves -- no c10d client retries or backtraces on the rank's
    stderr after the job (they once followed a passing ``make demo``)."""
    rank, dog = _start(_free_port(), "gone")
    assert rank.wait(timeout=60) == 0
    said = rank.communicate(timeout=60)[1]      # the watchdog holds the pipe until it ends
    assert "TCPStore" not in said and "socket.cpp" not in said, said[-2000:]
    # its pipe closes a moment before it exits: under load that moment is long
    deadline = time.monotonic() + 5
    while _alive(dog) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(dog), "the watchdog outlived its rank"
