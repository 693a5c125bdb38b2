"""The end of a distributed script: ``torchalpa.shutdown()`` exits without the interpreter's
teardown (``runtime/execution/mesh.py``), and a script that ends with ``dist.destroy_process_group()``
or nothing at all exits cleanly too, with its own status (``runtime/resilience/clean_exit.py``).

``benchmarks/clean_exit.py`` repeats the launches many times on a loaded machine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_shutdown_leaves_the_group_runs_atexit_handlers_and_exits_with_the_code(tmp_path):
    marker = tmp_path / "atexit_ran"
    script = textwrap.dedent(f"""
        import atexit
        import torch.distributed as dist
        import torchalpa
        from torchalpa.runtime.execution.mesh import init_distributed
        init_distributed()
        atexit.register(lambda: open({str(marker)!r}, "w").write(
            "initialized" if dist.is_initialized() else "left"))
        print("done", flush=True)
        torchalpa.shutdown(3)
        print("not reached")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 3, run.stderr[-2000:]
    assert run.stdout.split() == ["done"]
    assert marker.read_text() == "left"     # the group was left before the handlers ran


ENDINGS = {"shutdown": 0, "destroy": 0, "nothing": 0, "exit3": 3}


def test_a_finished_job_exits_with_its_own_status_however_it_ends(tmp_path):
    """One torchrun launch (2 ranks) per ending, all at once, with every heartbeat beating
    each millisecond (tests/exit_worker.py): before the exit handler, a store request in
    flight at the teardown aborted most such ranks ("terminate called without an active
    exception"). Each ends with its script's status: 0, or 3 for ``sys.exit(3)``."""
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    logs = {e: open(tmp_path / f"{e}.log", "w+") for e in ENDINGS}
    jobs = {e: subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node=2", worker, e], env=env, stdout=logs[e],
                                stderr=subprocess.STDOUT, text=True) for e in ENDINGS}
    for ending, job in jobs.items():
        job.wait(timeout=400)
        logs[ending].seek(0)
        output = logs[ending].read()
        assert "terminate called" not in output, f"{ending}: {output[-3000:]}"
        assert output.count(" finished: loss ") == 2, f"{ending}: {output[-3000:]}"
        if ENDINGS[ending] == 0:
            assert job.returncode == 0, f"{ending}: {output[-3000:]}"
        else:                  # torchrun reports the failed workers with their status
            assert job.returncode != 0 and f"exitcode  : {ENDINGS[ending]}" in output, \
                f"{ending}: {output[-3000:]}"
