"""Alpa's MoE layout on a (2, 2) mesh trains like one device on 4 gloo ranks
(tests/moe_2d_worker.py): the tokens, split over both axes, reach the experts split over
the inner axis by one all-to-all each way (no all-gather), and every step issues exactly
the plan's collectives. Slow: planning the MoE layer takes about a minute here."""

from __future__ import annotations

import pytest
import worker_io


@pytest.mark.slow
def test_moe_2d_alpa_layout_trains_like_one_device(tmp_path):
    r = worker_io.launch_checked("moe_2d_worker.py", tmp_path / "moe_2d.json", nproc=4)["moe_2d"]
    assert r["nested_all_to_alls"] >= 2, r["planned"]
    assert not any(kind == "all_gather" for kind, _, _ in r["planned"]), r["planned"]
    assert r["planned_per_step"][0] == r["planned"]       # loss.backward(); then train_step
    for executed, planned in zip(r["executed"], r["planned_per_step"], strict=True):
        assert executed == planned
    for ours, ref in zip(r["losses"], r["ref_losses"]):
        assert ours == pytest.approx(ref, rel=1e-5)
    assert r["grad_rel_diff"] < 1e-4
    assert r["param_rel_diff"] < 1e-4
