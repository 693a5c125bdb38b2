"""Plans are never trusted blindly: every damaged, planted or foreign cache entry is a miss
with a warning naming the file (then overwritten by a fresh plan), the cache directory
is private, and a plan given or loaded that does not fit the step is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import warnings
from pathlib import Path

import pytest
import torch.nn.functional as F
from models import MLP, mlp_inputs

import torchalpa
from torchalpa.core.plan import OUTPUT, PLAN_VERSION, OutputSlot
from torchalpa.core.plan_check import PlanError, check_plan
from torchalpa.frontends.torch_export import capture

METHOD = torchalpa.ShardParallel(logical_mesh_shape=(4,))
# gradients priced one all-reduce each (Alpa's accounting): this small MLP's plan is then
# sharded, which the edited-layout and uneven-split cases below need (bucket-priced, the
# plan is DDP's, all replicated)
CLUSTER = dataclasses.replace(torchalpa.Cluster.local_cpu(4), gradient_bucket_bytes=0)


def make_plan(hidden=16):
    return torchalpa.plan(MLP(hidden, 2), mlp_inputs(32, hidden), F.mse_loss, method=METHOD,
                          cluster=CLUSTER)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("TORCHALPA_CACHE_DIR", str(root))
    return root


@pytest.fixture(scope="module")
def fresh():
    """The plan solved without any cache, and another model's."""
    old = os.environ.get("TORCHALPA_CACHE")
    os.environ["TORCHALPA_CACHE"] = "0"
    try:
        return make_plan(), make_plan(hidden=8)
    finally:
        if old is None:
            del os.environ["TORCHALPA_CACHE"]
        else:
            os.environ["TORCHALPA_CACHE"] = old


def core(plan_or_text) -> dict:
    """What a plan decides (its timings of the solver left out)."""
    d = json.loads(plan_or_text if isinstance(plan_or_text, str) else plan_or_text.to_json())
    return {k: d[k] for k in ("graph_fingerprint", "mesh", "parameters", "strategies",
                              "reshards", "collectives")}


def the_entry(root):
    entries = [p for p in root.iterdir() if p.name.endswith(".json")]
    assert len(entries) == 1, entries
    return entries[0]


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """The cache entry a first run writes: its file name and text."""
    root = tmp_path_factory.mktemp("seed") / "cache"
    old = os.environ.get("TORCHALPA_CACHE_DIR")
    os.environ["TORCHALPA_CACHE_DIR"] = str(root)
    try:
        make_plan()
    finally:
        os.environ["TORCHALPA_CACHE_DIR"] = old or ""
    entry = the_entry(root)
    return entry.name, entry.read_text()


def seed(root, seeded):
    """A cache as the first run left it (without solving again)."""
    root.mkdir(mode=0o700)
    (root / seeded[0]).write_text(seeded[1])
    return root / seeded[0]


def edited_layout(text: str) -> str:
    d = json.loads(text)
    name = next(iter(d["parameters"]))
    d["parameters"][name]["placements"] = ["Replicate()"] * len(d["mesh"]["shape"])
    return json.dumps(d)


ENTRY_DAMAGE = {
    "empty list": lambda text, other: "[]",
    "null": lambda text, other: "null",
    "empty object": lambda text, other: "{}",
    "unknown keys": lambda text, other: json.dumps({"version": PLAN_VERSION, "what": 3}),
    "wrong type": lambda text, other: text.replace('"shape": [', '"shape": "x", "s": [', 1),
    "truncated": lambda text, other: text[:len(text) // 2],
    "binary garbage": lambda text, other: "\x00\xff" * 40,
    "old version": lambda text, other: text.replace(f'"version": {PLAN_VERSION}', '"version": 0',
                                                    1),
    "another model's plan": lambda text, other: other.to_json(),
    "edited layout": lambda text, other: edited_layout(text),
}


FAST_DAMAGE = ("null", "truncated", "another model's plan", "edited layout")


@pytest.mark.parametrize("damage", [
    d if d in FAST_DAMAGE else pytest.param(d, marks=pytest.mark.slow) for d in ENTRY_DAMAGE])
def test_a_bad_cache_entry_is_a_named_miss_and_is_replaced(cache_dir, fresh, seeded, damage):
    good, other = fresh
    entry = seed(cache_dir, seeded)
    entry.write_text(ENTRY_DAMAGE[damage](entry.read_text(), other))
    with pytest.warns(UserWarning, match=f"ignoring the cached plan.*{entry.name}"):
        got = make_plan()
    assert core(got) == core(good)
    assert core(entry.read_text()) == core(good)                      # overwritten


def test_a_directory_or_symlink_in_an_entrys_place_is_a_miss(cache_dir, fresh, seeded, tmp_path):
    good, _ = fresh
    entry = seed(cache_dir, seeded)
    entry.unlink()
    entry.mkdir()
    with pytest.warns(UserWarning, match=entry.name):
        assert core(make_plan()) == core(good)
    assert entry.is_file()
    victim = tmp_path / "victim.json"
    victim.write_text(good.to_json())               # a valid plan, behind a planted link
    entry.unlink()
    entry.symlink_to(victim)
    with pytest.warns(UserWarning, match=entry.name):
        assert core(make_plan()) == core(good)
    assert entry.is_file() and not entry.is_symlink()    # replaced, the victim untouched
    assert victim.read_text() == good.to_json()


def test_the_cache_directory_is_private_and_must_be_ours(cache_dir, fresh, seeded):
    make_plan()                                  # created by torchalpa: private
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
    os.chmod(cache_dir, 0o777)
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # a hit, no warning
        make_plan()
    assert stat.S_IMODE(cache_dir.stat().st_mode) == 0o700
    if os.getuid() != 0:
        pytest.skip("changing a directory's owner needs root")
    os.chown(cache_dir, 12345, 12345)
    with pytest.warns(UserWarning, match="belongs to uid 12345, not to you"):
        assert core(make_plan()) == core(fresh[0])
    os.chown(cache_dir, 0, 0)
    entry = the_entry(cache_dir)
    os.chown(entry, 12345, 12345)                # an entry planted by another user
    with pytest.warns(UserWarning, match="not a regular file of yours"):
        make_plan()


# -- plans given or loaded ---------------------------------------------------------------

@pytest.fixture(scope="module")
def step(fresh):
    graph = capture(MLP(16, 2), mlp_inputs(32, 16), F.mse_loss).graph
    return graph, fresh[0]


def test_a_plan_that_fits_passes(step):
    graph, plan = step
    check_plan(plan, fingerprint=graph.fingerprint(), source="plan=", mesh_shape=(4,),
               graph=graph)


@pytest.mark.parametrize("edit,message", [
    (edited_layout, r"reads operand 0 as S\(0\), but arg0_1 arrives as R"),
    (lambda t: t.replace('"shape": [\n    16,\n    16\n   ]',
                         '"shape": [\n    18,\n    16\n   ]', 1),
     r"splits dim 0 of \(18, 16\).*unevenly"),
    (lambda t: t.replace('"graph_fingerprint": "', '"graph_fingerprint": "x', 1),
     "different training step"),
])
def test_an_edited_plan_is_refused_by_name(step, tmp_path, edit, message):
    graph, plan = step
    path = tmp_path / "plan.json"
    path.write_text(edit(plan.to_json()))
    assert path.read_text() != plan.to_json()
    with pytest.raises(PlanError, match=message) as e:
        check_plan(torchalpa.Plan.load(path), fingerprint=graph.fingerprint(),
                   source=str(path), mesh_shape=(4,), graph=graph)
    assert str(path) in str(e.value)


def test_a_plan_for_another_mesh_is_refused(step):
    graph, plan = step
    with pytest.raises(PlanError, match=r"is for a mesh of \(4,\), this job's mesh is \(2, 2\)"):
        check_plan(plan, fingerprint=graph.fingerprint(), source="plan=", mesh_shape=(2, 2))


def test_a_truncated_plan_file_is_named(step, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(step[1].to_json()[:200])
    with pytest.raises(ValueError, match=f"{path} is not valid JSON.*truncated"):
        torchalpa.Plan.load(path)
    text = step[1].to_json()
    assert f'"version": {PLAN_VERSION}' in text
    path.write_text(text.replace(f'"version": {PLAN_VERSION}', '"version": 7', 1))
    with pytest.raises(ValueError, match=f"{path} is a plan of version 7"):
        torchalpa.load_plan(path)


def test_auto_parallel_refuses_an_edited_plan_by_name():
    import torch.distributed as dist
    x, y = mlp_inputs(32, 16)
    plan = torchalpa.plan(MLP(16, 2), (x, y), F.mse_loss,
                          method=torchalpa.ShardParallel())          # this world: one device
    d = json.loads(plan.to_json())
    name = next(iter(d["parameters"]))
    d["parameters"][name]["placements"] = ["Shard(0)"]
    try:
        with pytest.raises(PlanError, match=r"the plan passed as plan=: .* arrives as S\(0\)"):
            torchalpa.auto_parallel(MLP(16, 2), (x, y), F.mse_loss,
                                    plan=torchalpa.Plan.from_dict(d),
                                    method=torchalpa.ShardParallel())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_integer_features_are_refused_when_planning():
    import torch
    x, y = torch.randint(0, 5, (32, 16)), torch.randn(32, 16)
    with pytest.raises(TypeError, match=r"net\.0: aten\.mm\.default multiplies operands of "
                                        r"different dtypes .*int64.*x\.float\(\)"):
        torchalpa.plan(MLP(16, 2), (x, y), F.mse_loss, method=METHOD, cluster=CLUSTER)


def test_a_float32_table_under_mixed_precision_is_refused_with_the_fix():
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    class Tabled(nn.Module):          # a float32 table made inside forward, as rotary tables are
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, x):
            return self.proj(x) @ torch.ones(16, 16)

    x, y = torch.randn(32, 16), torch.randn(32, 16)
    policy = torchalpa.MixedPrecision(param_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"different dtypes .*bfloat16.*float32|float32.*bfloat16"
                                        r".*\.type_as\(x\)"):
        torchalpa.auto_parallel(Tabled(), (x, y), F.mse_loss, mixed_precision=policy,
                                method=torchalpa.ShardParallel())
    if dist.is_initialized():
        dist.destroy_process_group()


V1_PLAN = Path(__file__).parent / "data" / "plan_v1_gpt_tiny.json"
"""A GPT's plan on a 2x2 mesh as version 1 wrote it (output slots as "grad:<parameter>")."""


def test_version_1_plan_files_load_into_the_typed_records():
    old = json.loads(V1_PLAN.read_text())
    assert old["version"] == 1
    plan = torchalpa.load_plan(V1_PLAN)
    assert isinstance(plan, torchalpa.Plan) and plan.version == PLAN_VERSION
    outputs = [r for r in plan.reshards if r.consumer == OUTPUT]
    old_outputs = [r for r in old["reshards"] if r["consumer"] == "<output>"]
    assert outputs and len(outputs) == len(old_outputs)
    for r, o in zip(outputs, old_outputs):
        assert r.slot == OutputSlot.parse(o["slot"]) and r.slot.kind == "grad"
        assert r.slot.name in {p.name for p in plan.parameters}
    # every other decision reads back as it was written, and writes as version 2
    again = json.loads(plan.to_json())
    assert again["version"] == PLAN_VERSION
    for key in ("mesh", "parameters", "strategies", "collectives", "stages", "estimates"):
        assert again[key] == old[key], key
    assert [r for r in again["reshards"] if r["consumer"] != OUTPUT] == \
        [r for r in old["reshards"] if r["consumer"] != "<output>"]
    assert [r["slot"] for r in again["reshards"] if r["consumer"] == OUTPUT] == \
        [{"output": "grad", "name": r.slot.name} for r in outputs]
    assert torchalpa.Plan.from_json(plan.to_json()) == plan


def test_a_version_1_cache_entry_is_a_hit(cache_dir):
    from torchalpa.parallel import cache
    cache_dir.mkdir(mode=0o700)
    (cache_dir / "somekey.json").write_text(V1_PLAN.read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # no "ignoring the cached plan" warning
        plan = cache.load_cached("somekey")
    assert plan == torchalpa.load_plan(V1_PLAN)


def test_output_slots_refuse_what_they_cannot_mean():
    with pytest.raises(ValueError, match="none of"):
        OutputSlot("gradient", "w")
    with pytest.raises(ValueError, match="the loss has no name"):
        OutputSlot("grad")
    assert str(OutputSlot.grad("net.0.weight")) == "grad:net.0.weight"
    assert OutputSlot.parse("send:mm_3[1]") == OutputSlot.send("mm_3[1]")
