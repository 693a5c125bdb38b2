"""Models torchalpa was not written for (``torchalpa.suite.cases``: transformers
architectures with their default configs, torchvision classifiers, plain PyTorch idioms) train on 4 gloo ranks like
on one device: 3 AdamW steps, losses within 1e-5 relative, first gradients within 1e-5 of
their scale, parameters within 1e-5 (where gradients are above rounding noise, which AdamW
amplifies to ``lr`` per step; see tests/suite_worker.py), and every rank holding bitwise
the same block of each replicated value.

``FAST`` cases run in ``make test`` (one launch); the rest in ``make test-all`` (``-m slow``),
a few launches of several cases each. Cases with a ``known_failure`` are xfail (not strict):
they turn green once the work that owns them lands.

Every case also runs as ``name@2x2``: planned on Alpa's test mesh (2 x 2, the second axis
ten times faster), where tensor parallelism pays, so the plan splits weights as well as
the batch (``suite_worker.MESHES``); ``llama@2x2`` is in ``make test``.
"""

from __future__ import annotations

import pytest
import worker_io

from torchalpa.suite.cases import FAST, SUITE

SLOW = [name for name in SUITE if name not in FAST]
NUM_LAUNCHES = 4                      # slow cases are split into this many launches


ON_2X2 = [f"{name}@2x2" for name in SUITE]
FAST_2X2 = ("llama@2x2",)
SLOW_2X2 = [name for name in ON_2X2 if name not in FAST_2X2]


def launch(names, tmp_path, nproc: int = 4) -> dict:
    return worker_io.launch("suite_worker.py", tmp_path / "suite.json", ",".join(names),
                            nproc=nproc, timeout=3600, timeout_env="600")


def check(results: dict, name: str) -> None:
    case = SUITE[name.partition("@")[0]]
    r = results[name]
    if case.known_failure and "error" in r:
        pytest.xfail(case.known_failure)
    assert "error" not in r, f"{name}:\n{r.get('trace')}"
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert got == pytest.approx(want, rel=1e-5), (name, r["losses"], r["ref_losses"])
    # gradients relative to their scale; parameters where AdamW is not fed pure rounding
    # noise, and anywhere within what AdamW can move an entry (suite_worker.py explains)
    assert r["max_rel_grad_diff"] < 1e-5, (name, r["max_rel_grad_diff"])
    assert r["max_param_diff"] < 1e-5, (name, r["max_param_diff"])
    assert r["max_param_diff_anywhere"] <= r["param_bound_anywhere"] * 1.01
    assert all(r["loss_bits_agree"]), f"{name}: ranks returned different losses"
    assert r["replicated_differ"] == [], f"{name}: ranks differ on {r['replicated_differ']}"
    if "returns" in r:                         # keyword calls return the model's own output
        assert r["returns"] == r["ref_returns"]
    if "max_buffer_diff" in r:                 # batch-norm statistics, train step and predict
        assert r["max_buffer_diff"] < 1e-5


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    return launch(FAST + FAST_2X2, tmp_path_factory.mktemp("suite"))


@pytest.mark.parametrize("name", FAST + FAST_2X2)
def test_fast_cases_train_like_one_device(fast, name):
    check(fast, name)


_slow_results: dict[int, dict] = {}


def _slow_batch(index: int, tmp_path_factory) -> dict:
    if index not in _slow_results:
        names = SLOW[index::NUM_LAUNCHES]
        _slow_results[index] = launch(names, tmp_path_factory.mktemp(f"suite{index}"))
    return _slow_results[index]


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_suite_case_trains_like_one_device(tmp_path_factory, name):
    check(_slow_batch(SLOW.index(name) % NUM_LAUNCHES, tmp_path_factory), name)


_slow_2x2_results: dict[int, dict] = {}


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_2X2)
def test_suite_case_trains_like_one_device_on_a_2x2_mesh(tmp_path_factory, name):
    index = SLOW_2X2.index(name) % NUM_LAUNCHES
    if index not in _slow_2x2_results:
        _slow_2x2_results[index] = launch(SLOW_2X2[index::NUM_LAUNCHES],
                                          tmp_path_factory.mktemp(f"suite2x2_{index}"))
    check(_slow_2x2_results[index], name)
