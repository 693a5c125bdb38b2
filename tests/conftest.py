import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Plans cached by one test session must not leak into another (or into the user's cache).
import tempfile  # noqa: E402
os.environ["TORCHALPA_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchalpa-test-cache-")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` need CUDA: skipped on CPU-only machines (``make test-gpu``).
    Tests that run JAX go last: once XLA's backend has started its threads, forking (the
    multi-rank tests' workers) risks a deadlock in the child."""
    items.sort(key=lambda item: item.path.name == "test_stablehlo.py")   # stable sort
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

    from torchalpa.runtime.mesh import init_distributed
    init_distributed()
    yield dist.group.WORLD.group_name
    dist.destroy_process_group()
