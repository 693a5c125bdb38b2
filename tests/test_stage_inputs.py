"""Values a pipeline stage receives from another: only those whose dim 0 is the batch are
split as a batch. A tied embedding owned by the first stage reaches the last one as a
parameter (or its cast to the compute dtype) and comes back as a gradient; none of these
has a batch, so a vocabulary that the data-parallel degree does not divide must plan."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard

import torchalpa
from torchalpa.models.gpt import GPT, GPTConfig

VOCAB = 130            # does not divide by the 4 devices of a stage


def _loss(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _plan(mixed_precision):
    config = GPTConfig(vocab_size=VOCAB, max_seq_len=16, num_layers=2, num_heads=2, hidden=32)
    with torch.device("meta"):
        model = GPT(config)
    ids = torch.zeros(8, 16, dtype=torch.long, device="meta")
    option = torchalpa.AutoShardingOption(force_batch_dim_to_mesh_dim=0, solver="highs")
    # the first layer (the embedding) alone in stage 0: the tied head is in stage 1
    layers = torchalpa.AutoLayerOption(layer_num=4)
    method = torchalpa.PipeshardParallel(
        num_micro_batches=2, layer_option=layers, auto_sharding_option=option,
        stage_option=torchalpa.ManualStageOption(
            forward_stage_layer_ids=((0,), (1, 2, 3)), submesh_shapes=((1, 4), (1, 4)),
            logical_shapes=((4,), (4,)), options=(option, option)))
    cluster = torchalpa.Cluster(num_nodes=2, devices_per_node=4)
    return torchalpa.plan(model, (ids, ids), _loss, method=method, cluster=cluster,
                          mixed_precision=mixed_precision)


@pytest.mark.parametrize("precision", [None, torchalpa.MixedPrecision()],
                         ids=["float32", "bf16"])
def test_a_tied_embedding_crossing_stages_is_not_a_batch(precision):
    plan = _plan(precision)
    assert [s.layers for s in plan.stages] == [(0,), (1, 2, 3)]
    # the weight (or its cast) goes forward, its gradient comes back: whole, once each
    crossing = [t for t in plan.transfers if t.bytes >= VOCAB * 32 * 2]
    assert {t.src_stage for t in crossing} == {0, 1}
    # the real batch is still split over the stage's devices
    for stage in plan.stages:
        batch = [p for p in stage.plan.inputs if p.shape[0] == 4]
        assert batch and all(p.placements == (Shard(0),) for p in batch), stage.plan.inputs
