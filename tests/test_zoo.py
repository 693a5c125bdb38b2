"""Every model of the zoo trains under torchalpa on real gloo ranks like on one device:
losses over 5 AdamW steps, the first step's gradients, parameters at the end, and the
collectives of every step against the plan (tests/zoo_worker.py).

4 ranks on a 1D mesh and on 2x2 run in ``make test``; 2 ranks and 8 ranks on 2x4 are
slower and run in ``make test-all`` (``-m slow``).
"""

from __future__ import annotations

import pytest
import worker_io

FAMILIES = ["gpt", "llama", "bert", "vit", "resnet", "moe", "hf_gpt2", "hf_llama", "hf_bert"]


def launch(nproc: int, mesh: str, tmp_path) -> dict:
    return worker_io.launch("zoo_worker.py", tmp_path / f"zoo_{nproc}_{mesh}.json", mesh,
                            ",".join(FAMILIES), nproc=nproc, timeout=1800, timeout_env="300")


def check(r, family):
    assert "error" not in r, f"{family}:\n{r.get('trace')}"
    assert r["unsupported"] == [], f"{family} has ops without rules: {r['unsupported']}"
    # sharded sums change the order of float additions: ~1e-7 relative in practice
    for got, want in zip(r["losses"], r["ref_losses"]):
        assert got == pytest.approx(want, rel=1e-5)
    assert r["max_rel_grad_diff"] < 1e-5
    # AdamW divides near-zero gradients by their own size, amplifying rounding
    # differences up to lr x steps (5e-3) for such entries; real errors would be larger
    assert r["max_param_diff"] < 5e-3
    assert all(r["executed_equal_predicted"]), "a step issued other collectives than planned"


@pytest.fixture(scope="module")
def four_1d(tmp_path_factory):
    return launch(4, "1d", tmp_path_factory.mktemp("zoo"))


@pytest.fixture(scope="module")
def four_2x2(tmp_path_factory):
    return launch(4, "2x2", tmp_path_factory.mktemp("zoo"))


@pytest.mark.parametrize("family", FAMILIES)
def test_four_ranks_1d(four_1d, family):
    check(four_1d[family], family)


@pytest.mark.parametrize("family", FAMILIES)
def test_four_ranks_2x2(four_2x2, family):
    check(four_2x2[family], family)
    assert four_2x2[family]["mesh"] == [2, 2]


@pytest.mark.slow
@pytest.mark.parametrize("nproc,mesh", [(2, "1d"), (8, "2x4")])
def test_two_and_eight_ranks(tmp_path, nproc, mesh):
    results = launch(nproc, mesh, tmp_path)
    for family in FAMILIES:
        check(results[family], family)
