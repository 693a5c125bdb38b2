"""Into torchalpa: ``load_pretrained`` reads a safetensors snapshot into the shards.

A randomly initialized MLP is saved as ``torchalpa.save_pretrained`` saves a non-HF
model (``model.safetensors``) and as a sharded HF snapshot (index json + two files); two
plain ranks with another initialization load it into a ZeRO-3 plan (every parameter
sharded) and get the loss one device gets with the saved model, each reading only its
half. In one process: HF's own GPT-2 snapshot (tied ``lm_head``) loads into a planned
GPT-2, and the key checks name what is missing, unexpected or of another shape.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from models import MLP, FusedAttention, fused_inputs, mlp_inputs
from safetensors.torch import save_file, save_model
from test_faults_dist import _free_port

import torchalpa

HERE = os.path.dirname(os.path.abspath(__file__))


pytestmark = pytest.mark.usefixtures("single_process_world")   # conftest.py


def saved_mlp(directory, sharded: bool):
    """MLP(16, 3) with seed 0, written as one model.safetensors or as a sharded HF
    snapshot; the model itself is returned for the one-device reference."""
    torch.manual_seed(0)
    model = MLP(16, 3)
    directory.mkdir()
    if not sharded:
        save_model(model, str(directory / "model.safetensors"))
        return model
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    parts = {"model-00001-of-00002.safetensors": names[:3],
             "model-00002-of-00002.safetensors": names[3:]}
    for file, keys in parts.items():
        save_file({k: state[k] for k in keys}, str(directory / file))
    weight_map = {k: file for file, keys in parts.items() for k in keys}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return model


@pytest.fixture(scope="module")
def two_ranks_loaded(tmp_path_factory):
    """Both snapshots (single file, sharded index) loaded by one launch of two plain ranks:
    by ``sharded``, the loss one device gets with the saved model and what each rank saw."""
    root = tmp_path_factory.mktemp("pretrained")
    want, dirs = {}, {}
    for sharded in (False, True):
        dirs[sharded] = root / f"snapshot_{'sharded' if sharded else 'single'}"
        reference = saved_mlp(dirs[sharded], sharded)
        x, y = mlp_inputs(8, 16)
        with torch.no_grad():
            want[sharded] = F.mse_loss(reference(x), y).item()
    dirs["fused"] = root / "snapshot_fused"       # a strided shard reads a block per piece
    dirs["fused"].mkdir()
    torch.manual_seed(0)
    reference = FusedAttention()
    save_model(reference, str(dirs["fused"] / "model.safetensors"))
    with torch.no_grad():
        want["fused"] = F.mse_loss(reference(fused_inputs()[0]), fused_inputs()[1]).item()
    world = 2
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "pretrained_worker.py"),
                               str(root), *(str(d) for d in dirs.values())],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    logs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-3000:] for _, e in logs)
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(world)]
    return {sharded: (want[sharded], [seen[str(d)] for seen in ranks])
            for sharded, d in dirs.items()}


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded-index"])
def test_two_ranks_load_their_shards_and_match_one_device(two_ranks_loaded, sharded):
    want, ranks = two_ranks_loaded[sharded]
    world = len(ranks)
    for r, seen in enumerate(ranks):
        assert seen["loss"] == pytest.approx(want, rel=1e-6, abs=1e-7), f"rank {r}"
        assert seen["missing_keys"] == [] and seen["unexpected_keys"] == []
        # ZeRO-3 shards every parameter in two: a rank reads half of the model
        assert seen["read"] == seen["total"] // world, f"rank {r} read {seen['read']}"


def test_a_strided_shard_loads_its_heads_of_q_k_and_v(two_ranks_loaded):
    """A nanoGPT attention with c_attn held by heads (a block of each of q, k and v, which
    no one offset describes) loads the snapshot's values into its blocks: the loss one
    device gets with the saved model, on both ranks."""
    want, ranks = two_ranks_loaded["fused"]
    for r, seen in enumerate(ranks):
        assert seen["loss"] == pytest.approx(want, rel=1e-5), f"rank {r}"
        assert seen["missing_keys"] == [] and seen["unexpected_keys"] == []


def planned_mlp(seed=1):
    torch.manual_seed(seed)
    return torchalpa.auto_parallel(MLP(16, 3), mlp_inputs(8, 16), F.mse_loss,
                                   method=torchalpa.ShardParallel())


def test_missing_unexpected_and_mismatched_keys_are_named(tmp_path):
    reference = saved_mlp(tmp_path / "snapshot", sharded=False)
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    pm = planned_mlp()
    before = [p.full_tensor().clone() for p in pm.parameters()]

    partial = dict(state)
    del partial["net.2.bias"]
    partial["net.9.weight"] = torch.zeros(2)
    save_file(partial, str(tmp_path / "partial.safetensors"))
    with pytest.raises(ValueError, match=r"missing keys .*: net\.2\.bias; unexpected keys .*: "
                       r"net\.9\.weight; pass strict=False"):
        torchalpa.load_pretrained(pm, tmp_path / "partial.safetensors")
    assert all(torch.equal(a, p.full_tensor()) for a, p in zip(before, pm.parameters()))
    with pytest.warns(UserWarning, match=r"missing keys .*net\.2\.bias"):
        info = torchalpa.load_pretrained(pm, tmp_path / "partial.safetensors", strict=False)
    assert info == {"missing_keys": ["net.2.bias"], "unexpected_keys": ["net.9.weight"]}
    loaded = dict(pm.module.named_parameters())
    assert torch.equal(loaded["net.0.weight"].full_tensor(), state["net.0.weight"])
    assert torch.equal(loaded["net.2.bias"].full_tensor(), before[3])   # kept its value

    wrong = dict(state, **{"net.0.weight": torch.zeros(16, 8)})
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    with pytest.raises(ValueError, match=r"size mismatch for net\.0\.weight: the snapshot has "
                       r"shape \[16, 8\], the model \[16, 16\]"):
        torchalpa.load_pretrained(pm, tmp_path / "wrong.safetensors", strict=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        torchalpa.load_pretrained(pm, tmp_path / "empty")


def test_an_hf_snapshot_with_tied_weights_loads_into_a_planned_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    from torchalpa.models.hf import hf_config, hf_loss_fn
    config = hf_config("gpt2")
    torch.manual_seed(0)
    original = transformers.GPT2LMHeadModel(config).eval()
    original.save_pretrained(tmp_path / "gpt2")                 # lm_head stored once, tied
    ids = torch.randint(config.vocab_size, (2, 8))
    loss_fn = hf_loss_fn("gpt2")
    with torch.no_grad():
        want = loss_fn(original(ids), ids).item()
    torch.manual_seed(1)
    pm = torchalpa.auto_parallel(transformers.GPT2LMHeadModel(config).eval(),
                                 (ids, ids.clone()), loss_fn, method=torchalpa.ShardParallel())
    info = torchalpa.load_pretrained(pm, tmp_path / "gpt2")
    assert info == {"missing_keys": [], "unexpected_keys": []}
    with torch.no_grad():
        assert pm(ids, ids.clone()).item() == pytest.approx(want, rel=1e-5)


def test_a_truncated_or_pickled_file_of_a_sharded_snapshot_is_named_and_nothing_loads(tmp_path):
    """The second file of a sharded snapshot cut short, or an index that names a ``.bin``
    (a pickle, never unpickled): the error names the file and what is wrong with it, and
    no parameter changed (every file's header is checked before anything is read)."""
    saved_mlp(tmp_path / "snapshot", sharded=True)
    pm = planned_mlp()
    before = [p.full_tensor().clone() for p in pm.parameters()]
    second = tmp_path / "snapshot" / "model-00002-of-00002.safetensors"
    whole = second.read_bytes()
    second.write_bytes(whole[:-10])
    with pytest.raises(ValueError, match=rf"{second.name} \(named by model.safetensors.index"
                       rf"\.json\) is truncated: its header describes {len(whole)} bytes, the "
                       rf"file has {len(whole) - 10}"):
        torchalpa.load_pretrained(pm, tmp_path / "snapshot")
    assert all(torch.equal(a, p.full_tensor()) for a, p in zip(before, pm.parameters()))

    second.write_bytes(whole)
    index = tmp_path / "snapshot" / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    pickled = {k: torch.zeros(1) for k, f in weight_map.items() if f == second.name}
    torch.save(pickled, tmp_path / "snapshot" / "pytorch_model-00002.bin")
    index.write_text(json.dumps({"weight_map": {
        k: "pytorch_model-00002.bin" if f == second.name else f for k, f in weight_map.items()}}))
    with pytest.raises(ValueError, match=r"pytorch_model-00002\.bin \(named by .*\) is a PyTorch "
                       r"pickle file \(torch.save\), not safetensors.*safetensors\.torch\."
                       r"save_file\(torch\.load\('pytorch_model-00002\.bin'"):
        torchalpa.load_pretrained(pm, tmp_path / "snapshot")
    assert all(torch.equal(a, p.full_tensor()) for a, p in zip(before, pm.parameters()))
    with pytest.raises(ValueError, match=r"pytorch_model-00002\.bin is a PyTorch pickle"):
        torchalpa.load_pretrained(pm, tmp_path / "snapshot" / "pytorch_model-00002.bin")
    only_pickles = tmp_path / "pickled"
    only_pickles.mkdir()
    (tmp_path / "snapshot" / "pytorch_model-00002.bin").rename(only_pickles / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match=r"neither model.safetensors nor .*it has "
                       r"pytorch_model\.bin, a PyTorch pickle file: convert it once"):
        torchalpa.load_pretrained(pm, only_pickles)
    assert all(torch.equal(a, p.full_tensor()) for a, p in zip(before, pm.parameters()))
    with pytest.warns(UserWarning, match="missing keys"):   # an intact file still loads
        torchalpa.load_pretrained(pm, second.parent / "model-00001-of-00002.safetensors",
                                  strict=False)
