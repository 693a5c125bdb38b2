import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Plans cached by one test session must not leak into another (or into the user's cache).
import tempfile  # noqa: E402

os.environ["TORCHALPA_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchalpa-test-cache-")
# The suite's ranks run on CPUs over gloo, also on a GPU machine (four ranks cannot share
# its one GPU under NCCL); tests marked gpu switch to CUDA (the fixture in test_gpu.py).
os.environ.setdefault("TORCHALPA_DEVICE", "cpu")


# Summed seconds of each file's tests in `make test` (setup included: a module fixture's
# launch counts), from one run of the suite with `--junitxml` and benchmarks/test_times.py
# (11-30, load 5-24, so up to twice a quiet machine's figures), less what was then moved to
# make test-all or shrunk (test_auto.py, test_uniform_floor.py, test_uniform_budget.py,
# test_ilp_highs.py); files not listed took under 5 s. Only the order of files comes from
# these figures, never a result: stale ones cost time, not correctness; a long file left
# unlisted is handed out last and keeps one worker busy while the other idles.
FILE_SECONDS = {
    "test_auto.py": 104, "test_distributed.py": 88, "test_faults_dist.py": 84,
    "test_pipeline.py": 82, "test_uniform_floor.py": 81, "test_runtime_dist.py": 76,
    "test_rules.py": 63, "test_shutdown.py": 49, "test_rebatch.py": 46, "test_zoo.py": 43,
    "test_spelling.py": 40, "test_suite.py": 39, "test_seq_parallel_plan.py": 37,
    "test_alpa_runs.py": 35, "test_relaxed_bound.py": 32, "test_mesh_bound.py": 31,
    "test_layer_remat_offload.py": 29, "test_uniform_budget.py": 27, "test_cli.py": 26,
    "test_published.py": 25, "test_layer_bound.py": 24, "test_stablehlo.py": 23,
    "test_deterministic.py": 22, "test_checkpoint.py": 21, "test_planner.py": 21,
    "test_stage_polish.py": 21, "test_alpa_shard_parallel.py": 20, "test_models.py": 20,
    "test_stage_bounds.py": 20, "test_pipeline_once.py": 19, "test_plan_variety.py": 18,
    "test_ilp_highs.py": 18, "test_runtime.py": 15, "test_search_parallel.py": 15,
    "test_layering.py": 13, "test_plan_start.py": 13, "test_shape_bound.py": 13,
    "test_states_floor.py": 13, "test_worker_io.py": 12, "test_devices.py": 11,
    "test_faults_checkpoint.py": 11, "test_memory_rows.py": 11, "test_zero1_precision.py": 11,
    "test_cross_entropy.py": 10, "test_generate.py": 10, "test_calibrate_compute.py": 9,
    "test_pretrained.py": 9, "test_transplant.py": 9, "test_random.py": 8,
    "test_launcher_stop.py": 8, "test_progress.py": 8, "test_memory_measured.py": 7,
    "test_bf16_kernels.py": 7, "test_in_flight_reuse.py": 7, "test_reshard.py": 7,
    "test_search_sharing.py": 7, "test_simplify.py": 5, "test_stage_dp_work.py": 5,
}


def _file_order(item) -> tuple:
    """In one process: JAX's tests last (once XLA's backend has started its threads,
    forking, as the multi-rank tests' workers do, risks a deadlock in the child). Under
    pytest-xdist (``make test``; ``pytest_configure`` makes this the order files are
    handed out in): the longest files first, so that the last file a
    worker takes is a short one and the other worker is not left idle meanwhile (the
    longest-first rule for scheduling jobs on two machines)."""
    name = item.path.name
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return (name == "test_stablehlo.py",)
    return (-FILE_SECONDS.get(name, 0),)


def pytest_configure(config):
    """pytest-xdist's --dist loadfile hands out files with the most tests first by default
    (``--loadscope-reorder``); a test's count says little of its time here (test_rules.py:
    214 tests, 34 s; test_zoo.py: 10 tests, 56 s), so ``make test`` keeps the collection
    order ``_file_order`` gives, as --no-loadscope-reorder would."""
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Files in the order ``_file_order`` gives (tests within a file keep theirs). Tests
    marked ``gpu`` need CUDA: skipped on CPU-only machines (``make test-gpu``)."""
    items.sort(key=_file_order)                                           # stable sort
    _skip_browser_tests_without_chromium(items)
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (make test-gpu on a GPU machine)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def _skip_browser_tests_without_chromium(items):
    """Tests marked ``browser`` need headless Chromium: skipped where it is missing, with the
    command that installs it, except under ``make test-browser``
    (``TORCHALPA_REQUIRE_BROWSER=1``), where a missing browser fails them."""
    from headless import chromium
    if chromium() is not None or os.environ.get("TORCHALPA_REQUIRE_BROWSER") == "1":
        return
    skip = pytest.mark.skip(reason="needs chromium: `make test-browser` installs it "
                                   "(apt-get install -y chromium)")
    for item in items:
        if item.get_closest_marker("browser") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _quiet_torch_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*autograd kernel was not registered.*")
        yield


@pytest.fixture(autouse=True, scope="module")
def _no_process_group_left_between_files():
    """Each test file starts without a process group, whatever ran before it in this
    worker: a test that calls ``auto_parallel`` in this process starts a one-rank group
    (``runtime/execution/mesh.py``) and not every such test tears it down
    (``single_process_world``); with files handed out by their measured length
    (``FILE_SECONDS``), test_planner.py's "plans with no process group" ran after one."""
    yield
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def single_process_world():
    """Tear down the one-rank process group a test's auto_parallel call started."""
    yield
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def one_rank_group():
    """A gloo group of one rank in this process (collectives are identities)."""
    import torch.distributed as dist

    from torchalpa.runtime.execution.mesh import init_distributed
    init_distributed()
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()


@pytest.fixture
def ilp_calls(monkeypatch):
    """The mesh shapes of ``plan_intra_op``'s calls (a view's ILPs) since the test began;
    the plan cache off (its key does not see ``PassSwitches``: a second solve would be a
    hit and not counted)."""
    import torchalpa.passes.sharding.intra_op as intra_op
    monkeypatch.setenv("TORCHALPA_CACHE", "0")
    calls = []
    solve = intra_op.plan_intra_op

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return solve(*args, **kwargs)
    monkeypatch.setattr(intra_op, "plan_intra_op", counted)
    return calls
