"""One rank of a persistent pool of gloo ranks (started by ``worker_io.launch``): it joins
the process group once, then runs test workers' ``main()`` one job after another, so a
test session pays Python + torch import and the rendezvous once per world size instead
of once per launch. The collectives stay real: separate processes exchanging data over
gloo, each with its own RNG, default group and dispatcher state, exactly as under torchrun.

Protocol: one JSON line per job on stdin, ``{"worker": path, "args": [...]}`` (or
``{"exit": true}``); one line on the private reply pipe (the original stdout) per job,
``ok`` or ``failed at <time.time()>`` (so the launcher can tell which rank failed first:
the others usually fail only because it left their collectives). Everything the worker
prints goes to stderr (a log file the launcher shows when a job fails). A job that fails
leaves the group in an unknown state: this rank replies and exits, and the launcher starts
a fresh pool for the next job.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch.distributed as dist  # noqa: E402
import worker_io  # noqa: E402

from torchalpa.runtime.execution.mesh import init_distributed  # noqa: E402


def load_worker(path: str, cache: dict):
    """The worker module at ``path``, imported once per process (its imports are the cost
    the pool saves)."""
    if path not in cache:
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        cache[path] = module
    return cache[path]


def serve() -> None:
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                      # the workers' prints go to the log, not the replies
    sys.stdout = sys.stderr
    worker_io.POOLED = True
    init_distributed()
    modules: dict = {}
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("exit"):
            break
        print(f"== job {job['worker']} {job['args']}", file=sys.stderr, flush=True)
        sys.argv = [job["worker"], *job["args"]]
        try:
            load_worker(job["worker"], modules).main()
        except BaseException:          # SystemExit too: the job did not finish
            traceback.print_exc()
            sys.stderr.flush()
            reply.write(f"failed at {time.time():.3f}\n")   # the launcher names the first
            os._exit(1)
        sys.stderr.flush()
        reply.write("ok\n")
    dist.destroy_process_group()
    sys.stderr.flush()
    os._exit(0)                        # see worker_io.finish: skip gloo's teardown


if __name__ == "__main__":
    serve()
