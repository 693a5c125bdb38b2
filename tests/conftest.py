import os
import sys
import warnings

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Plans cached by one test session must not leak into another (or into the user's cache).
import tempfile  # noqa: E402
os.environ["TORCHALPA_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchalpa-test-cache-")


@pytest.fixture(autouse=True)
def _quiet_torch_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*autograd kernel was not registered.*")
        yield
