"""Process group and DeviceMesh from the launch environment (torchrun or a single process).

NCCL when CUDA is present, gloo otherwise (``TORCHALPA_DEVICE=cpu`` chooses CPUs and gloo on a
GPU machine: ``torchalpa.core.cluster.cuda_selected``). Without torchrun the world is this one
process, so the same code runs on a laptop with no launcher.
"""

from __future__ import annotations

import datetime
import math
import os
from collections.abc import Callable
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchalpa.core.cluster import cuda_selected
from torchalpa.runtime.resilience import clean_exit

__all__ = ["default_backend", "default_device", "init_distributed", "build_mesh", "rank",
           "world_size", "check_world_size", "on_rank0", "gather_objects", "comm_device",
           "shutdown"]

_TIMEOUT_ENV = "TORCHALPA_TIMEOUT_S"


def default_backend() -> str:
    return "nccl" if cuda_selected() else "gloo"


def default_device() -> torch.device:
    if cuda_selected():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def collective_timeout() -> datetime.timedelta:
    """How long a collective may wait for a peer before failing (``TORCHALPA_TIMEOUT_S``)."""
    return datetime.timedelta(seconds=float(os.environ.get(_TIMEOUT_ENV, 600)))


def _check_one_device_per_rank() -> None:
    """NCCL needs a GPU of its own per rank: say so before a rank asks for a device that is
    not there (an invalid-ordinal error) or NCCL refuses a shared one."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    devices = torch.cuda.device_count()
    if local_ranks > devices or local_rank >= devices:
        raise RuntimeError(
            f"{local_ranks} ranks on this node but {devices} CUDA device(s): NCCL needs one "
            f"GPU per rank. Launch at most {devices} per node (torchrun --nproc_per_node="
            f"{devices}), or set TORCHALPA_DEVICE=cpu to run these ranks on CPUs over gloo.")


def init_distributed() -> None:
    """Join the torchrun world, or make a world of one process if not launched by torchrun.
    The process then leaves it cleanly at exit, however the script ends (``clean_exit``)."""
    clean_exit.install()
    if dist.is_initialized():
        return
    if cuda_selected():
        _check_one_device_per_rank()
        torch.cuda.set_device(default_device())
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(default_backend(), timeout=collective_timeout())
    else:
        dist.init_process_group(default_backend(), store=dist.HashStore(), rank=0, world_size=1,
                                timeout=collective_timeout())


def shutdown(exit_code: int = 0) -> NoReturn:
    """End a distributed job's process now: leave the process group, run the ``atexit``
    handlers and flush, then exit with ``exit_code`` without the interpreter's teardown.

    A script that simply ends, or ends with ``dist.destroy_process_group()``, exits cleanly
    too: torchalpa's exit handler stops its threads and leaves the group before the
    teardown (``runtime/resilience/clean_exit.py``), where a thread caught in a C++ call would abort
    a finished process ("terminate called without an active exception", SIGABRT; seen on
    loaded machines, pytorch/pytorch#179291). This is the explicit form, which skips the
    teardown altogether; it does not return."""
    import atexit
    import logging
    import sys
    if dist.is_initialized():
        dist.destroy_process_group()
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def check_world_size(shape: tuple[int, ...]) -> None:
    """A mesh of ``shape`` must use every rank of the job."""
    n = math.prod(shape)
    if n != world_size():
        raise ValueError(
            f"the mesh {tuple(shape)} needs {n} ranks but this job has {world_size()}; launch "
            f"with torchrun --nproc_per_node={n} or pass a mesh/logical_mesh_shape that "
            f"multiplies to {world_size()}")


def build_mesh(shape: tuple[int, ...], axis_names: tuple[str, ...]) -> DeviceMesh:
    """A DeviceMesh of ``shape`` over the whole world (which must have that many ranks)."""
    init_distributed()
    check_world_size(shape)
    return init_device_mesh(default_device().type, tuple(shape), mesh_dim_names=tuple(axis_names))


_T = TypeVar("_T")


def gather_objects(obj: _T) -> list[_T]:
    """Every rank's ``obj`` (picklable) in rank order, on every rank (one all-gather);
    ``[obj]`` without a process group or alone in it."""
    if world_size() == 1:
        return [obj]
    everyone: list = [None] * world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def comm_device() -> torch.device:
    """Where the default process group's collectives take tensors: this rank's GPU under
    NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def on_rank0(compute: Callable[[], _T], what: str) -> _T:
    """``compute()`` on rank 0, its result (picklable) on every rank; an error there is
    raised on every rank (naming ``what``), so none waits forever for the others. Without
    a process group, or alone in it, ``compute()`` simply runs."""
    if world_size() == 1:
        return compute()
    payload: list = [None]
    if dist.get_rank() == 0:
        try:
            payload = [("ok", compute())]
        except Exception as e:  # sent to every rank, then raised everywhere
            dist.broadcast_object_list([("error", f"{type(e).__name__}: {e}")], src=0)
            raise
    dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "error":
        raise RuntimeError(f"{what} failed on rank 0: {value}")
    return value
