"""Pipeline schedules: every stage runs each micro-batch once, in an order that cannot
deadlock, holding as many micro-batches as the schedule promises."""

import pytest

from torchalpa.core.schedules import check_schedule, gpipe, in_flight, one_f_one_b


@pytest.mark.parametrize("stages,micro", [(1, 1), (2, 4), (4, 4), (4, 8), (3, 2), (8, 4)])
@pytest.mark.parametrize("make", [gpipe, one_f_one_b])
def test_schedules_run(make, stages, micro):
    check_schedule(make(stages, micro), micro)


def test_one_f_one_b_holds_fewer_micro_batches():
    S, B = 4, 8
    assert [in_flight(a) for a in gpipe(S, B)] == [B] * S
    assert [in_flight(a) for a in one_f_one_b(S, B)] == [4, 3, 2, 1]


def test_one_f_one_b_shape():
    assert one_f_one_b(2, 3) == [
        [("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2)],
        [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)],
    ]


def test_a_bad_order_is_caught():
    bad = [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]
    with pytest.raises(ValueError, match="deadlock"):
        check_schedule(bad, 1)
    with pytest.raises(ValueError, match="exactly once"):
        check_schedule([[("F", 0)]], 1)


def test_simulated_1f1b_matches_the_pipeline_formula():
    """Equal stages: a 1F1B step takes (B + S - 1) x (forward + backward) of one stage."""
    from torchalpa.core.schedules import simulate
    S, B, f, b = 4, 8, 1.0, 2.0
    timeline = simulate(one_f_one_b(S, B), [f] * S, [b] * S)
    makespan = max(e for stage in timeline for _, _, _, e in stage)
    assert makespan == pytest.approx((B + S - 1) * (f + b))
    gp = simulate(gpipe(S, B), [f] * S, [b] * S)
    assert max(e for stage in gp for _, _, _, e in stage) == pytest.approx((B + S - 1) * (f + b))
