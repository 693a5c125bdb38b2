"""Run on 4 gloo ranks by tests/test_cross_entropy.py: a tiny zoo GPT whose loss is the fused
``torchalpa::cross_entropy`` (``GPTConfig(loss="fused")``), planned with ShardParallel on a
2 x 2 mesh (the batch split on the first axis, so the loss's tokens are split) or as a
two-stage pipeline of 2 ranks each, trained 3 Adam steps beside the same model on one
device computing eager ``F.cross_entropy``. Rank 0 writes what it saw as JSON to argv[1];
argv[2] lists the scenarios (``shard:4``, ``pipe:4``, ``vocab:4``, ``vocabpipe:4``).

``vocab:4``: a tied head whose table is pinned split by vocabulary on axis 1, planned on a
2 x 2 mesh priced like the vocab-parallel test of ``dist_worker.py``, with the fused loss
taking ignore_index and label smoothing: the loss keeps the logits split by vocabulary
(its statistics all-reduced, ``runtime/lowering/synced.py``) and trains like one device's
``F.cross_entropy``. ``vocabpipe:4``: the same loss after an untied head (vocabulary
4096, width 256) pinned split by vocabulary, in the second of two pipeline stages of 2
ranks each (Cluster.local_cpu prices it: the split is chosen there, not pinned).

Records: the loss op's layouts (operands and results, in every stage that has one), the
losses on both sides, the first step's gradients (ShardParallel: a pipeline rank holds
its own stage's only), the parameters after the last step,
and each step's collectives next to the plan's.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from pipeline_worker import _stage_ranks  # noqa: E402
from worker_io import max_rel, rel_to_scale, run_scenarios, train_beside_one_device  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402
from torchalpa.models.losses import lm_loss  # noqa: E402
from torchalpa.ops.cross_entropy import cross_entropy  # noqa: E402

BATCH = 8
SMOOTHING = 0.1


class TiedLM(torch.nn.Module):
    """(B, S) tokens -> logits (B, S, 64) through a tied embedding (a head split by
    vocabulary where the table is)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.mix = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.mix(self.embed(x))) @ self.embed.weight.T


def smoothed_fused(logits, targets):
    return cross_entropy(logits, targets, ignore_index=-100, label_smoothing=SMOOTHING)


def smoothed_eager(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                             ignore_index=-100, label_smoothing=SMOOTHING)


class UntiedLM(torch.nn.Module):
    """(B, S) tokens -> logits (B, S, 4096): two blocks (one per pipeline stage) and an
    untied head."""

    def __init__(self, vocab: int = 4096, hidden: int = 256):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.mix2 = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):
        return self.head(torch.tanh(self.mix2(torch.tanh(self.mix(self.embed(x))))))


def twins(cls):
    """Two models of ``cls`` with the same initial weights: one to plan, one reference."""
    torch.manual_seed(0)
    model = cls()
    torch.manual_seed(0)
    return model, cls()


def token_batches(seed: int, vocab: int):
    """``batch_of(step)``: the same tokens and targets on every rank (seeded by ``seed +
    step``), the first two targets of every fourth row ignored (-100)."""
    def batch_of(step: int):
        gen = torch.Generator().manual_seed(seed + step)
        tokens, targets = (torch.randint(0, vocab, (8, 6), generator=gen) for _ in range(2))
        targets[::4, :2] = -100
        return tokens, targets
    return batch_of


def run_vocab_pipe() -> dict:
    """``vocabpipe:4`` (module docstring)."""
    model, ref = twins(UntiedLM)
    batch_of = token_batches(300, 4096)

    method = torchalpa.PipeshardParallel(
        num_micro_batches=2, layer_option=torchalpa.AutoLayerOption(layer_num=2),
        auto_sharding_option=torchalpa.AutoShardingOption(
            pin=(("head.weight", ("...", "S(0)")),)),
        stage_option=torchalpa.ManualStageOption(
            forward_stage_layer_ids=[[0], [1]], submesh_shapes=[(1, 2), (1, 2)]))
    pm = torchalpa.auto_parallel(model, batch_of(0), smoothed_fused, method=method,
                                 cluster=torchalpa.Cluster.local_cpu(4),
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    return {"layouts": loss_layouts(pm.plan),
            **pipelined(pm, ref, ref_opt, batch_of, ref_loss=smoothed_eager)}


def run_vocab() -> dict:
    """``vocab:4`` (module docstring)."""
    model, ref = twins(TiedLM)
    batch_of = token_batches(200, 64)

    option = torchalpa.AutoShardingOption(
        pin=(("embed.weight", (torchalpa.Replicate(), torchalpa.Shard(0))),),
        force_batch_dim_to_mesh_dim=0, allow_mixed_mesh_shape=False)
    pm = torchalpa.auto_parallel(
        model, batch_of(0), smoothed_fused,
        method=torchalpa.ShardParallel(logical_mesh_shape=(2, 2), auto_sharding_option=option),
        cluster=torchalpa.LogicalMesh(shape=(2, 2)),
        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    run = train_beside_one_device(pm, ref, ref_opt, batch_of, smoothed_eager, steps=3)
    return {"layouts": loss_layouts(pm.plan),
            "executed": run["executed"], "planned_per_step": run["planned"],
            "losses": run["losses"], "ref_losses": run["ref_losses"],
            "grad_rel_diff": max_rel(run["grads"][0]),
            "param_diff_to_scale": rel_to_scale(run["params"])}


def method_of(name: str):
    option = torchalpa.AutoShardingOption(force_batch_dim_to_mesh_dim=0)
    if name == "shard":
        return torchalpa.ShardParallel(logical_mesh_shape=(2, 2), auto_sharding_option=option)
    return torchalpa.PipeshardParallel(
        num_micro_batches=2, layer_option=torchalpa.AutoLayerOption(layer_num=2),
        auto_sharding_option=option,
        stage_option=torchalpa.ManualStageOption(
            forward_stage_layer_ids=[[0], [1]], submesh_shapes=[(1, 2), (1, 2)]))


def loss_layouts(plan) -> list[str]:
    """The fused loss op's operand and result layouts, per plan (stage) that holds it."""
    plans = [s.plan for s in plan.stages] if hasattr(plan, "num_micro_batches") else [plan]
    return [f"{[str(p) for p in s.inputs]} -> {[str(p) for p in s.outputs]}"
            for p in plans for s in p.strategies
            if s.node.split(".")[0] in ("cross_entropy", "cross_entropy_backward")]


def run(name: str, ranks: str) -> dict:
    if name == "vocab":
        return run_vocab()
    if name == "vocabpipe":
        return run_vocab_pipe()
    workload = zoo.tiny("gpt", batch_size=BATCH, dropout=0.0, loss="fused")
    torch.manual_seed(0)
    model = workload.build()
    torch.manual_seed(0)
    ref = workload.build()

    def batch_of(step: int):
        torch.manual_seed(100 + step)         # the same global batch on every rank
        inputs, targets = workload.example_inputs()
        # ignored positions, as many in each half (the pipeline's micro-batches average
        # their own means): the mean counts the rest
        targets[::BATCH // 2, :3] = -100
        return inputs, targets

    pm = torchalpa.auto_parallel(model, batch_of(0), workload.loss_fn, method=method_of(name),
                                 cluster=torchalpa.Cluster.local_cpu(int(ranks)),
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    if name == "pipe":
        return {"layouts": loss_layouts(pm.plan), **pipelined(pm, ref, ref_opt, batch_of)}
    run = train_beside_one_device(pm, ref, ref_opt, batch_of, lm_loss, steps=3)
    return {"layouts": loss_layouts(pm.plan),
            "executed": run["executed"], "planned_per_step": run["planned"],
            "losses": run["losses"], "ref_losses": run["ref_losses"],
            "grad_rel_diff": max_rel(run["grads"][0]),
            "param_diff_to_scale": rel_to_scale(run["params"])}


def pipelined(pm, ref, ref_opt, batch_of, steps: int = 3, ref_loss=lm_loss) -> dict:
    """``train_step`` of a pipeline beside ``ref`` (its loss ``ref_loss``); every stage's
    parameters compared on their stage's ranks (the largest difference over all ranks, to
    the largest value)."""
    out: dict = {"losses": [], "ref_losses": []}
    for step in range(steps):
        batch = batch_of(step)
        out["losses"].append(pm.train_step(*batch).item())
        loss = ref_loss(ref(*batch[:-1]), batch[-1])
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        out["ref_losses"].append(loss.item())
    worst = torch.zeros(2)
    for (name, p), q in zip(pm.module.named_parameters(), ref.parameters()):
        if dist.get_rank() in _stage_ranks(pm.plan, name):
            full = p.full_tensor()
            worst = torch.maximum(worst, torch.tensor([(full - q).abs().max().item(),
                                                       q.abs().max().item()]))
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    out["param_diff_to_scale"] = (worst[0] / worst[1]).item()
    return out


def main():
    run_scenarios(run)


if __name__ == "__main__":
    main()
