"""What every torchrun test worker does around its scenarios: record each one's result
or its error (so the test shows the trace instead of a hang or a bare exit code), then
have rank 0 write them all as JSON, leave the process group together and exit."""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch.distributed as dist


def attempt(run) -> dict:
    """``run()``, or the error it raised with its trace."""
    try:
        return run()
    except Exception as e:  # recorded for the test to show
        return {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}


def finish(results: dict, out_path: str) -> None:
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    # Results are written and every rank has left the group: skip interpreter teardown.
    # Gloo threads still holding work objects can abort a process there ("terminate
    # called without an active exception"; seen about once in 60 launches here), failing
    # a launch whose checks all passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
