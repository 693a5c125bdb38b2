"""The typed records a plan carries (torchalpa/core/plan_records.py): estimates and per-parameter
explanations, serialized in one place in the form plan files of versions 1 and 2 hold."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from torchalpa.core.plan import Plan
from torchalpa.core.plan_records import Estimates, Explanation, LayoutCost

V1 = os.path.join(os.path.dirname(__file__), "data", "plan_v1_gpt_tiny.json")


def test_estimates_are_read_as_fields_never_by_string_key():
    est = Estimates.from_dict({"step_time_s": 0.5, "objective": 2.0})
    assert est.step_time_s == 0.5 and est.objective == 2.0 and est.compute_s is None
    assert est.to_dict() == {"step_time_s": 0.5, "objective": 2.0}      # the set fields
    with pytest.raises(TypeError):
        est["step_time_s"]                 # a record, not a mapping: one way to read it
    assert not hasattr(est, "get")
    more = dataclasses.replace(est, compute_s=0.1)
    assert more.compute_s == 0.1 and est.compute_s is None        # frozen: a new record


def test_a_misspelled_estimate_is_named():
    with pytest.raises(ValueError, match=r"unknown plan estimate\(s\) 'step_time'"):
        Estimates.from_dict({"step_time": 1.0})


def test_a_version_1_file_reads_into_records_and_writes_back_the_same_data():
    with open(V1) as f:
        raw = json.load(f)
    plan = Plan.from_dict(raw)
    assert isinstance(plan.estimates, Estimates)
    assert plan.estimates.step_time_s == raw["estimates"]["step_time_s"]
    why = plan.explanations["wte.weight"]
    assert isinstance(why, Explanation) and isinstance(why.runner_up, LayoutCost)
    assert why.chosen.placements == tuple(raw["explanations"]["wte.weight"]["placements"])
    out = plan.to_dict()
    assert out["estimates"] == raw["estimates"]
    assert out["explanations"] == raw["explanations"]
    again = Plan.from_json(plan.to_json())
    assert again.estimates == plan.estimates and again.explanations == plan.explanations


def test_dicts_given_to_a_plan_become_records():
    plan = Plan(mesh_shape=(2,), axis_names=("x",), parameters=(), inputs=(), strategies=(),
                reshards=(), collectives=(), estimates={"step_time_s": 0.1},
                explanations={"w": {"placements": ["Shard(0)"], "communication_s": 0.0,
                                    "state_bytes": 8}})
    assert plan.estimates.step_time_s == 0.1
    assert plan.explanations["w"] == Explanation(LayoutCost(("Shard(0)",), 0.0, 8))
