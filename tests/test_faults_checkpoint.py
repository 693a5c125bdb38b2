"""Checkpoints under faults, in one process: a save stopped at every point of its commit
leaves the previous version loadable; damaged or planted files are named, never loaded
or run; a flipped byte fails its checksum; dropout resumes bit-identically (the random
state is saved).

A save "killed" here raises from the fault hook at the named point: with no cleanup on
the way out, the files left behind are those a SIGKILL at that point leaves (the
multi-process kills are in tests/test_faults_dist.py).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from checkpoint_damage import KINDS, differences, held_state, plant
from models import mlp_inputs

import torchalpa
from torchalpa.runtime.state import checkpoint as ck
from torchalpa.runtime.state.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

POINTS = ("started", "data_written", "before_manifest", "before_rename", "before_latest",
          "before_prune")
# what `load_checkpoint` finds after a save stopped there: the old version or the new
LOADS_AFTER_KILL = {"started": "old", "data_written": "old", "before_manifest": "old",
                    "before_rename": "old", "before_latest": "old", "before_prune": "new"}


@pytest.fixture(autouse=True)
def single_process_world():
    yield
    ck._fault_hook = None
    if dist.is_initialized():
        dist.destroy_process_group()


class Killed(BaseException):
    """Stands for SIGKILL: nothing catches it on the way out."""


def make(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 16))
    return torchalpa.auto_parallel(model, mlp_inputs(8, 16), F.mse_loss,
                                   optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2),
                                   method=torchalpa.ShardParallel())


def weights(pm) -> list[torch.Tensor]:
    return [p.full_tensor().clone() for p in pm.parameters()]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_versions_latest_pointer_and_keep(tmp_path):
    pm = make()
    x, y = mlp_inputs(8, 16)
    saved = []
    for _ in range(4):
        pm.train_step(x, y)
        saved.append(save_checkpoint(tmp_path, pm, keep=2, extra={"step": len(saved)}).name)
    assert saved == ["ckpt-000001", "ckpt-000002", "ckpt-000003", "ckpt-000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000003", "ckpt-000004", "latest"]
    assert (tmp_path / "latest").read_text().strip() == "ckpt-000004"
    assert ck.checkpoint_extra(tmp_path) == {"step": 3}
    fresh = make(seed=1)
    assert load_checkpoint(tmp_path, fresh).name == "ckpt-000004"
    assert same(weights(fresh), weights(pm))
    load_checkpoint(tmp_path / "ckpt-000003", fresh)          # one version by name
    assert not same(weights(fresh), weights(pm))
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        save_checkpoint(tmp_path, pm, keep=0)


@pytest.mark.parametrize("point", POINTS)
def test_a_save_stopped_anywhere_leaves_a_complete_checkpoint(tmp_path, point):
    pm = make()
    x, y = mlp_inputs(8, 16)
    pm.train_step(x, y)
    save_checkpoint(tmp_path, pm)
    old = weights(pm)
    pm.train_step(x, y)
    new = weights(pm)

    def hook(reached):
        if reached == point:
            raise Killed(point)
    ck._fault_hook = hook
    with pytest.raises(Killed):
        save_checkpoint(tmp_path, pm)
    ck._fault_hook = None
    fresh = make(seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_checkpoint(tmp_path, fresh)
    assert same(weights(fresh), old if LOADS_AFTER_KILL[point] == "old" else new)
    partial = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    if partial:           # named when loading, removed by the next save
        assert any(partial[0] in str(w.message) for w in caught)
    save_checkpoint(tmp_path, pm)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert same(weights(fresh), old if LOADS_AFTER_KILL[point] == "old" else new)


def test_a_first_save_stopped_early_is_named_and_never_loaded(tmp_path):
    pm = make()
    ck._fault_hook = lambda p: (_ for _ in ()).throw(Killed(p)) if p == "data_written" else None
    with pytest.raises(Killed):
        save_checkpoint(tmp_path, pm)
    ck._fault_hook = None
    with pytest.raises(CheckpointError,
                       match=r"no complete checkpoint .*only partial.*\.tmp-ckpt-000001"):
        load_checkpoint(tmp_path, make(seed=1))


def test_damaged_files_are_named(tmp_path):
    pm = make()
    version = save_checkpoint(tmp_path, pm)
    data = next(p for p in version.iterdir() if p.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[:100])                 # truncated
    with pytest.raises(CheckpointError, match=f"{data.name} has 100 bytes"):
        load_checkpoint(tmp_path, make(seed=1))
    data.unlink()
    with pytest.raises(CheckpointError, match=f"{data.name} is missing"):
        load_checkpoint(tmp_path, make(seed=1))
    (tmp_path / "latest").write_text("../../etc\n")
    with pytest.raises(CheckpointError, match="does not name a checkpoint version"):
        load_checkpoint(tmp_path, make(seed=1))


def flip_one_byte(path) -> None:
    """A bit rot: one byte in the middle of ``path`` changes, its size does not."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def reseal(version) -> None:
    """Rewrite the manifest's checksums to match the files (an attacker who can write the
    checkpoint can do this too: the checksums catch damage, not malice)."""
    manifest = json.loads((version / ck.MANIFEST).read_text())
    for name, entry in manifest["files"].items():
        entry["sha256"] = hashlib.sha256((version / name).read_bytes()).hexdigest()
    (version / ck.MANIFEST).write_text(json.dumps(manifest))


def test_every_file_has_a_checksum_in_the_manifest(tmp_path):
    version = save_checkpoint(tmp_path, make())
    manifest = json.loads((version / ck.MANIFEST).read_text())
    on_disk = sorted(p.name for p in version.iterdir() if p.name != ck.MANIFEST)
    assert sorted(manifest["files"]) == on_disk
    assert {".metadata", "rng-0.pt"} <= set(on_disk)
    for name in on_disk:
        data = (version / name).read_bytes()
        assert manifest["files"][name] == {"bytes": len(data),
                                           "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("victim", ["distcp", ".metadata", "rng-0.pt"])
def test_a_flipped_byte_is_named_and_the_previous_version_offered(tmp_path, victim):
    pm = make()
    x, y = mlp_inputs(8, 16)
    save_checkpoint(tmp_path, pm)
    old = weights(pm)
    pm.train_step(x, y)
    version = save_checkpoint(tmp_path, pm)
    damaged = next(p for p in version.iterdir()
                   if p.name == victim or (victim == "distcp" and p.suffix == ".distcp"))
    flip_one_byte(damaged)
    fresh = make(seed=1)
    before = weights(fresh)
    with pytest.raises(CheckpointError, match=rf"ckpt-000002 is damaged: {damaged.name} does "
                       r"not match its checksum.*ckpt-000001 is intact.*fallback=True"):
        load_checkpoint(tmp_path, fresh)
    assert same(weights(fresh), before), "a damaged checkpoint was partly loaded"
    with pytest.warns(UserWarning, match=rf"{damaged.name} does not match.*loading the newest "
                      r"intact version, .*ckpt-000001"):
        assert load_checkpoint(tmp_path, fresh, fallback=True).name == "ckpt-000001"
    assert same(weights(fresh), old)
    with pytest.raises(CheckpointError, match=rf"{damaged.name} does not match its checksum"):
        load_checkpoint(version, fresh)            # that version by name: nothing older


def test_with_every_version_damaged_nothing_loads(tmp_path):
    pm = make()
    for _ in range(2):
        version = save_checkpoint(tmp_path, pm)
        flip_one_byte(next(p for p in version.iterdir() if p.suffix == ".distcp"))
    with pytest.raises(CheckpointError, match=r"ckpt-000002 is damaged.*ckpt-000001 is damaged"
                       r".*No intact earlier version"):
        load_checkpoint(tmp_path, make(seed=1), fallback=True)


class _Payload:
    """Unpickling this runs ``os.system``-like code: it creates a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_loading_runs_no_code_planted_in_the_checkpoint(tmp_path):
    pm = make()
    version = save_checkpoint(tmp_path, pm)
    marker = tmp_path / "PWNED"
    planted = pickle.dumps(_Payload(str(marker)))
    metadata = version / ".metadata"
    good_metadata = metadata.read_bytes()
    for victim in (".metadata", "rng-0.pt"):
        target = version / victim
        original = target.read_bytes()
        target.write_bytes(planted.ljust(len(original), b"\n"))   # sizes still match
        with pytest.raises(CheckpointError, match=rf"{victim} does not match its checksum"):
            load_checkpoint(tmp_path, make(seed=1))
        reseal(version)                                # past the checksums: not unpickled
        with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
            load_checkpoint(tmp_path, make(seed=1))
        assert not marker.exists(), f"code planted in {victim} ran on load"
        target.write_bytes(original)
        reseal(version)
    assert metadata.read_bytes() == good_metadata
    load_checkpoint(tmp_path, make(seed=1))                       # intact again: loads


def test_dropout_resumes_bit_identically(tmp_path):
    x, y = mlp_inputs(8, 16)
    pm = make(dropout=0.3)
    pm.train_step(x, y)
    save_checkpoint(tmp_path, pm)
    uninterrupted = [pm.train_step(x, y).item() for _ in range(3)]
    torch.manual_seed(12345)                 # another random state: the checkpoint restores it
    fresh = make(seed=1, dropout=0.3)
    load_checkpoint(tmp_path, fresh)
    resumed = [fresh.train_step(x, y).item() for _ in range(3)]
    assert resumed == uninterrupted
    torch.manual_seed(12345)
    again = make(seed=1, dropout=0.3)
    load_checkpoint(tmp_path, again, rng=False)          # without it, dropout draws others
    assert [again.train_step(x, y).item() for _ in range(3)] != uninterrupted


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("optimizer_state", ["trained", "none yet"])
def test_a_refused_load_changes_nothing(tmp_path, kind, optimizer_state):
    """A file read late is bad (the manifest rewritten to match): the load raises, naming
    it, and the model, optimizer, random state and step counter are bit-identical."""
    pm = make()
    x, y = mlp_inputs(8, 16)
    pm.train_step(x, y)
    good = save_checkpoint(tmp_path / "good", pm)
    saved = held_state(pm)
    bad = save_checkpoint(tmp_path / "bad", make(seed=2))
    name = plant(bad, kind, rank=0)
    if optimizer_state == "trained":
        pm.train_step(x, y)
        torch.rand(3)                        # the random state moves on from the saves
    else:
        pm = make(seed=1)                    # an optimizer with no state yet
    held = held_state(pm)
    with pytest.raises(CheckpointError, match=rf"ckpt-000001 cannot be loaded: rank 0: "
                       rf".*{name}.*Nothing was loaded"):
        load_checkpoint(bad, pm)
    assert differences(held_state(pm), held) == []
    assert load_checkpoint(good, pm) == good                 # a good one still loads
    # all of it as saved; the step counter counts this process's calls, not in a checkpoint
    assert differences(held_state(pm), saved) == ["step counter"]
