"""How the multi-rank tests run their workers, on both sides.

Worker side (tests/*_worker.py): record each scenario's result or its error (so the test
shows the trace instead of a hang or a bare exit code), then have rank 0 write them all
as JSON and leave the process group together.

Test side: ``launch`` runs a worker's ``main()`` on ``nproc`` gloo ranks, either on a
persistent pool of rank processes (tests/rank_pool.py; started once per world size and
reused, so a session pays torch's import and the rendezvous once instead of per launch),
or, with ``real=True``, under a fresh ``torchrun`` as a user would (the smoke tests that
keep the launcher path itself covered). Both are real processes exchanging real data
over gloo: numerics and counted collectives are the same either way.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
import traceback

import torch.distributed as dist

from torchalpa.runtime.lowering.strided_dtensor import full_value

HERE = os.path.dirname(os.path.abspath(__file__))
POOLED = False        # set by tests/rank_pool.py: finish() then keeps the group for the next job
# The pool's ranks serve every worker, so they take the longest collective timeout any
# launch asked for (the suite's: rank 0 plans while the others wait); it only matters when
# a job hangs, and then the launch's own time limit (below) ends it first.
POOL_TIMEOUT_S = "600"


# How long a rank whose scenario raised waits for the other ranks to finish that scenario
# too before it stops the job (they are then stuck in a collective it will never join).
SCENARIO_WAIT_S = float(os.environ.get("TORCHALPA_TEST_SCENARIO_WAIT_S", "10"))
_attempted: dict[int, int] = {}     # per rank: scenarios begun so far (equal on every rank)


class ScenarioDivergedError(RuntimeError):
    """A scenario raised on this rank while other ranks were still inside it."""


def attempt(run, *, wait_s: float | None = None) -> dict:
    """``run()``, or the error it raised with its trace.

    A recorded error lets the next scenario run, which is right only when every rank left
    this one (all raised alike, or the others finished). Otherwise the others are waiting
    in a collective this rank will never join, and the job would hang until the pool's
    timeout and then show another rank's "Connection closed". So each rank marks each
    scenario done in the process group's store, and a rank that raised waits up to
    ``wait_s`` (default ``SCENARIO_WAIT_S``) for the others' marks; missing ones stop the
    job with this rank's trace (its process exits, which ends the others' collectives).
    """
    wait_s = SCENARIO_WAIT_S if wait_s is None else wait_s
    index = _begin_scenario()
    start = time.monotonic()
    try:
        result = run()
    except Exception as e:  # recorded for the test to show
        recorded = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        stuck = _mark_scenario_done(index, failed=True, wait_s=wait_s)
        if stuck:
            raise ScenarioDivergedError(
                f"rank {dist.get_rank()}: scenario #{index} raised {recorded['error']}; "
                f"rank(s) {stuck} were still inside it after {wait_s:g} s "
                f"(waiting in a collective with this rank): stopping the job") from e
        return recorded
    _mark_scenario_done(index, failed=False, wait_s=0)
    _log_scenario_time(index, time.monotonic() - start)
    return result


def _log_scenario_time(index: int, seconds: float) -> None:
    """With TORCHALPA_TEST_SCENARIO_TIMES=<file>, rank 0 appends each scenario's seconds
    (worker, argv, index): how the suite's time is profiled per scenario of a launch."""
    path = os.environ.get("TORCHALPA_TEST_SCENARIO_TIMES")
    if path and (not _multi_rank() or dist.get_rank() == 0):
        with open(path, "a") as f:
            f.write(f"{seconds:8.2f}s  {os.path.basename(sys.argv[0])} #{index} "
                    f"{' '.join(sys.argv[2:])[:80]}\n")


def _multi_rank() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _begin_scenario() -> int:
    rank = dist.get_rank() if _multi_rank() else 0
    _attempted[rank] = _attempted.get(rank, 0) + 1
    return _attempted[rank]


def _mark_scenario_done(index: int, *, failed: bool, wait_s: float) -> list[int]:
    """Mark scenario ``index`` done on this rank; after a failure, the ranks that did not
    mark it within ``wait_s`` (none when every rank left it)."""
    if not _multi_rank():
        return []
    store = dist.distributed_c10d._get_default_store()
    key = f"torchalpa_test/scenario/{index}/"
    store.set(key + str(dist.get_rank()), "failed" if failed else "ok")
    if not failed:
        return []
    others = [r for r in range(dist.get_world_size()) if r != dist.get_rank()]
    deadline = time.monotonic() + wait_s
    while True:
        stuck = [r for r in others if not store.check([key + str(r)])]
        if not stuck or time.monotonic() > deadline:
            return stuck
        time.sleep(0.05)


def finish(results: dict, out_path: str) -> None:
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    if POOLED:
        return
    dist.destroy_process_group()
    # Results are written and every rank has left the group: skip interpreter teardown.
    # Gloo threads still holding work objects can abort a process there ("terminate
    # called without an active exception"; seen about once in 60 launches here), failing
    # a launch whose checks all passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_scenarios(run, argv=None) -> None:
    """A worker's main: ``argv[1]`` is the JSON path rank 0 writes, ``argv[2]`` the
    scenarios, ``name:arg`` comma separated; ``run(name, arg)`` gives each one's result
    (an error is recorded by ``attempt`` and the next scenario runs)."""
    from torchalpa.runtime.execution.mesh import init_distributed
    argv = sys.argv if argv is None else argv
    out_path, which = argv[1], argv[2].split(",")
    init_distributed()
    results: dict = {"world_size": dist.get_world_size()}
    for scenario in which:
        name, arg = scenario.split(":")
        results[scenario] = attempt(lambda: run(name, arg))
    finish(results, out_path)


def run_listed_scenarios(scenarios, argv=None) -> None:
    """A worker's main for a list of scenarios: ``scenarios(world_size)`` gives ``(name,
    run)`` pairs; ``argv[1]`` is the JSON path rank 0 writes, ``argv[2]`` (optional) the
    names to run, comma separated (all when absent)."""
    from torchalpa.runtime.execution.mesh import init_distributed
    argv = sys.argv if argv is None else argv
    out_path = argv[1]
    wanted = set(argv[2].split(",")) if len(argv) > 2 else None
    init_distributed()
    results: dict = {"world_size": dist.get_world_size()}
    for name, run in scenarios(dist.get_world_size()):
        if wanted is None or name in wanted:
            results[name] = attempt(run)
    finish(results, out_path)


def mesh_shape(text: str) -> tuple[int, ...]:
    """``"2x2"`` -> ``(2, 2)``."""
    return tuple(int(n) for n in text.split("x"))


# -- worker side: training beside one device ------------------------------------------------

def train_beside_one_device(pm, ref, ref_opt, batch_of_step, loss_fn, *, steps: int,
                            backward_steps=(0,), scale: float = 1.0,
                            seed_of_step=None) -> dict:
    """Train ``pm`` (with its optimizer) and ``ref`` (the same model on one device, with
    ``ref_opt``) side by side for ``steps`` steps on ``batch_of_step(step)`` (its last item
    is the target) and record what the tests compare.

    A step in ``backward_steps`` runs ``pm(*batch)``, ``(loss * scale).backward()``, then
    ``pm.optimizer.step()``, with both sides' gradients recorded before the optimizer
    touches them; any other step runs ``pm.train_step(*batch)`` (which has no ``scale``:
    keep it 1 then). ``seed_of_step(step)``, when given, seeds torch before each side of
    the step, so random ops (dropout) draw the same on both. Every step's collectives are
    counted at the dispatcher.

    Returns ``losses`` / ``ref_losses`` (floats per step), ``executed`` (per step, sorted
    ``[kind, mesh axis, bytes]``), ``planned`` (the same, as ``pm.collectives_per_step``
    lists that step: a train_step's loss may ride a gradient bucket), ``grads`` (per backward step, ``[max |ours - ref|,
    max |ref|]`` per parameter whose reference gradient exists) and ``params`` (the same
    pairs for the parameters after the last step); ``max_rel`` and ``rel_to_scale`` reduce
    such pairs.
    """
    import torch

    from torchalpa.runtime.measurement.comm_count import CollectiveCounter
    if scale != 1.0 and set(range(steps)) - set(backward_steps):
        raise ValueError("train_step cannot scale the loss: with scale != 1, every step must "
                         "be in backward_steps")
    out: dict = {"losses": [], "ref_losses": [], "executed": [], "planned": [], "grads": []}
    for step in range(steps):
        batch = batch_of_step(step)
        if seed_of_step is not None:
            torch.manual_seed(seed_of_step(step))
        with CollectiveCounter.for_mesh(pm.mesh) as counter:
            if step in backward_steps:
                loss = pm(*batch)
                (loss * scale).backward()
            else:
                loss = pm.train_step(*batch)
        out["executed"].append(sorted([r.kind, r.axis, r.bytes] for r in counter.records))
        out["planned"].append(sorted([c.kind, c.axis, c.bytes] for c in pm.collectives_per_step(
            train_step=step not in backward_steps)))
        if seed_of_step is not None:
            torch.manual_seed(seed_of_step(step))
        ref_loss = loss_fn(ref(*batch[:-1]), batch[-1])
        (ref_loss * scale).backward()
        if step in backward_steps:
            out["grads"].append(_diffs([p.grad for p in pm.parameters()],
                                       [q.grad for q in ref.parameters()]))
            pm.optimizer.step()
            pm.optimizer.zero_grad(set_to_none=True)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
        out["ref_losses"].append(ref_loss.item())
    out["params"] = _diffs(list(pm.parameters()), list(ref.parameters()))
    return out


def named_input_faults(build, batch_of_call, *, bad_rank: int, corrupt,
                       calls: int = 2) -> tuple[dict, dict]:
    """A data-loader bug on one rank, under each ``check_inputs`` mode.

    For each mode of "first", "always", "never": ``pm = build(mode)``, then ``calls`` calls
    ``pm(*batch)`` with ``batch = batch_of_call()``, which rank ``bad_rank`` replaces by
    ``corrupt(batch)`` (same shapes, other values). Returns the ``ValueError`` message
    each call raised (or None) per mode, and the module built per mode (for checks that
    continue on one, such as check_replicas).
    """
    raised_by_mode: dict = {}
    modules: dict = {}
    for mode in ("first", "always", "never"):
        pm = build(mode)
        raised = []
        for _ in range(calls):
            args = batch_of_call()
            if dist.get_rank() == bad_rank:
                args = corrupt(args)
            try:
                pm(*args)
                raised.append(None)
            except ValueError as e:
                raised.append(str(e))
        raised_by_mode[mode], modules[mode] = raised, pm
    return raised_by_mode, modules


def _diffs(ours, refs) -> list:
    """``[max |ours - ref|, max |ref|]`` per pair whose reference exists (DTensors gathered)."""
    pairs = []
    for p, q in zip(ours, refs):
        if q is None:
            continue
        p = full_value(p)
        pairs.append([(p - q).abs().max().item(), q.abs().max().item()])
    return pairs


def max_rel(pairs) -> float:
    """The largest difference relative to its own tensor's magnitude."""
    return max(d / max(s, 1e-12) for d, s in pairs)


def rel_to_scale(pairs) -> float:
    """The largest difference relative to the largest magnitude of all tensors (for
    gradients that are zero in exact arithmetic and float noise on both sides)."""
    return max(d for d, _ in pairs) / max(s for _, s in pairs)


# -- test side ----------------------------------------------------------------------------

def launch(worker: str, out, *args: str, nproc: int, timeout: float = 600,
           timeout_env: str = "120", real: bool = False) -> dict:
    """Run ``tests/<worker>`` on ``nproc`` ranks with argv ``[out, *args]``; the JSON rank 0
    wrote to ``out``. ``real``: under a fresh torchrun (``timeout_env`` is then its
    TORCHALPA_TIMEOUT_S), else on the pool of ``nproc`` ranks. TORCHALPA_TEST_TORCHRUN=1
    makes every launch a fresh torchrun (to compare timings, or to rule the pool out)."""
    path = os.path.join(HERE, worker)
    argv = [str(out), *map(str, args)]
    if real or os.environ.get("TORCHALPA_TEST_TORCHRUN") == "1":   # every launch its own
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", path, *argv]
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHALPA_TIMEOUT_S=timeout_env)
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    else:
        _pool(nproc).run(path, argv, timeout)
    with open(out) as f:
        return json.load(f)


def launch_checked(worker: str, out, *args: str, nproc: int, **kwargs) -> dict:
    """``launch``, then check what came back: the worker ran on ``nproc`` ranks (where it
    says) and no scenario recorded an error (else the test fails with that scenario's trace).
    For a fixture whose tests need every scenario; where each test reads its own, use
    ``launch`` and ``scenario``, so that one failing scenario fails only its tests."""
    results = launch(worker, out, *args, nproc=nproc, **kwargs)
    assert results.get("world_size", nproc) == nproc, results.get("world_size")
    for name in results:
        scenario(results, name)
    return results


def scenario(results: dict, name: str):
    """``results[name]``, or, when that scenario recorded an error, the test fails with its
    trace (not a KeyError on the result it could not give)."""
    r = results[name]
    if isinstance(r, dict) and "error" in r and "trace" in r:
        import pytest
        pytest.fail(f"scenario {name} failed on {results.get('world_size', '?')} ranks:\n"
                    f"{r['trace']}")
    return r


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankPool:
    """``nproc`` processes of tests/rank_pool.py in one gloo group, fed jobs on stdin."""

    def __init__(self, nproc: int):
        self.nproc = nproc
        self.logs = [tempfile.NamedTemporaryFile("w+", prefix=f"rank_pool{nproc}_{r}_",
                                                 suffix=".log", delete=False)
                     for r in range(nproc)]
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), OMP_NUM_THREADS="1",
                   TORCHALPA_TIMEOUT_S=POOL_TIMEOUT_S)
        self.procs = [subprocess.Popen(
            [sys.executable, os.path.join(HERE, "rank_pool.py")],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.logs[r]) for r in range(nproc)]

    def run(self, path: str, argv: list, timeout: float) -> None:
        """One job on every rank; a failure (or a rank that does not answer in time)
        closes the pool, so the next launch starts a fresh one, and fails with the logs."""
        job = (json.dumps({"worker": path, "args": argv}) + "\n").encode()
        try:
            for p in self.procs:
                assert p.stdin is not None
                p.stdin.write(job)
                p.stdin.flush()
            replies = self._replies(time.monotonic() + timeout)
        except OSError as e:                     # a rank had died before the job
            replies = [f"unreachable ({e})"] * self.nproc
        if replies != ["ok"] * self.nproc:
            logs = self._log_tails(_first_failed(replies))
            self.close(kill=True)
            raise AssertionError(f"{os.path.basename(path)} on the {self.nproc}-rank pool: "
                                 f"replies {replies}\n{logs}")

    def _replies(self, deadline: float) -> list:
        """Each rank's reply, read as they come; the first rank that fails or dies ends the
        wait (the others are then stuck in a collective with it), as does the deadline."""
        replies: list = [None] * self.nproc
        pending = {p.stdout: r for r, p in enumerate(self.procs)}
        while pending:
            ready, _, _ = select.select(list(pending), [], [],
                                        max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for pipe in ready:
                r = pending.pop(pipe)
                replies[r] = pipe.readline().decode().strip() or \
                    f"died (exit {self.procs[r].wait()})"
            if any(x not in (None, "ok") for x in replies):
                break
        return [x or "no answer" for x in replies]

    def _log_tails(self, first: int | None) -> str:
        """Each rank's log tail, the rank that failed first (its trace is the cause) first."""
        tails = []
        order = sorted(range(self.nproc), key=lambda r: r != first)
        for r in order:
            self.logs[r].flush()
            with open(self.logs[r].name) as f:
                header = f"--- rank {r}{' (failed first)' if r == first else ''} ---\n"
                tails.append(header + f.read()[-4000:])
        return "\n".join(tails)

    def close(self, kill: bool = False) -> None:
        if _POOLS.get(self.nproc) is self:
            del _POOLS[self.nproc]
        for p in self.procs:
            if not kill and p.poll() is None:
                try:
                    assert p.stdin is not None
                    p.stdin.write(b'{"exit": true}\n')
                    p.stdin.close()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=0 if kill else 30)
            except subprocess.TimeoutExpired:
                pass
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in self.logs:
            log.close()
            os.unlink(log.name)


def _first_failed(replies: list) -> int | None:
    """The rank whose ``failed at <time>`` reply is the earliest, if any."""
    times = {r: float(x.rsplit(" ", 1)[1]) for r, x in enumerate(replies)
             if isinstance(x, str) and x.startswith("failed at ")}
    return min(times, key=lambda r: times[r]) if times else None


_POOLS: dict[int, RankPool] = {}


def _pool(nproc: int) -> RankPool:
    if nproc not in _POOLS:
        _POOLS[nproc] = RankPool(nproc)
    return _POOLS[nproc]


@atexit.register
def _close_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
