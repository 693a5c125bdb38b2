"""The SIGTERM handler a rank installs under torchrun (runtime/resilience/launcher_stop.py) stays the
rank's: a process forked from it (the planner's stage-solving pool) that is stopped with
SIGTERM no longer ends the rank. It did: the child inherited the wakeup fd, its SIGTERM
reached the rank's watcher, and the rank exited 143 in the middle of planning (seen as
the eight-rank pipeline test's rank 0 dying in its second stage solve)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

PROBE = textwrap.dedent("""
    import multiprocessing as mp, os, time
    os.environ["TORCHELASTIC_RUN_ID"] = "probe"       # what torchrun sets
    from torchalpa.runtime.resilience import launcher_stop

    class Monitor:
        rank = 0
        def culprits(self):
            return {}, []
        def leaving(self, failed, dead):
            pass

    assert launcher_stop.install(Monitor())
    child = mp.get_context("fork").Process(target=time.sleep, args=(60,))
    child.start()
    time.sleep(0.5)
    child.terminate()            # SIGTERM, as multiprocessing.Pool's exit sends its workers
    child.join()
    time.sleep(2 * launcher_stop.MAIN_THREAD_GRACE_S + 1)   # the watcher would have acted
    print("alive", child.exitcode)
""")


def test_a_forked_child_stopped_by_sigterm_leaves_the_rank_alive():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_RUN_ID", None)
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.split() == ["alive", "-15"]     # the child itself did die of it
