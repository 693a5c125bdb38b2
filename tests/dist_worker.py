"""Run under torchrun by tests/test_distributed.py: real gloo ranks, several scenarios per
launch (launches are the slow part). Rank 0 writes what it saw as JSON to argv[1].

For each scenario: train 3 Adam steps with torchalpa and on a single device from the same
init and data, record both losses, the largest parameter difference, and -- for every
step -- the collectives counted at the dispatcher next to the plan's list.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from models import MLP, FusedAttention, WithCustomOp, fused_attention_by_heads, mlp_inputs  # noqa: E402
from worker_io import attempt, finish, max_rel, train_beside_one_device  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.runtime.execution.mesh import init_distributed  # noqa: E402

ALPA_UNIT = lambda n: torchalpa.LogicalMesh(shape=(n,), alpha=(1.0,), beta=(1.0,))  # noqa: E731


def train_and_compare(make_model, batch, *, steps=3, lr=1e-3, scale=1.0, use_train_step=False,
                      loss_fn=F.mse_loss, optimizer=torch.optim.Adam, **auto_kw):
    torch.manual_seed(0)
    model = make_model()
    torch.manual_seed(0)
    ref = make_model()
    x, y = batch
    auto_kw.setdefault("method", torchalpa.ShardParallel())    # the scenarios are intra-op
    pm = torchalpa.auto_parallel(model, (x, y), loss_fn,
                                 optimizer=(lambda ps: optimizer(ps, lr=lr)), **auto_kw)
    # what a step issues: the plan's collectives, gradient all-reduces merged into buckets
    # (and by train_step, the loss's all-reduce inside one of them)
    predicted = sorted([c.kind, c.axis, c.bytes]
                       for c in pm.collectives_per_step(train_step=use_train_step))
    out = {"predicted": predicted,
           "per_gradient": sorted([c.kind, c.axis, c.bytes] for c in pm.plan.collectives),
           "kinds": sorted({c.kind for c in pm.plan.collectives}),
           "unsupported": [u["op"] for u in pm.plan.unsupported_ops],
           "mesh": list(pm.plan.mesh_shape),
           "placements": {p.name: [str(q) for q in p.placements] for p in pm.plan.parameters},
           "lookups": [[str(q) for q in s.inputs[0]] for s in pm.plan.strategies
                       if s.node.startswith("embedding") and "backward" not in s.node],
           "products": [[str(q) for q in s.outputs[0]] for s in pm.plan.strategies
                        if s.node.startswith("batched_matmul")],
           "synced": sorted([c.tensor, c.reduce_op, c.axis] for c in pm.plan.collectives
                            if c.tensor.startswith("_log_softmax")),
           "extremes": sorted([c.kind, c.reduce_op, c.bytes] for c in pm.plan.collectives
                              if c.reduce_op in ("max", "min"))}
    run = train_beside_one_device(
        pm, ref, optimizer(ref.parameters(), lr=lr), lambda step: batch, loss_fn,
        steps=steps, scale=scale, backward_steps=() if use_train_step else range(steps))
    out.update(losses=run["losses"], ref_losses=run["ref_losses"], executed=run["executed"],
               planned=run["planned"],
               max_param_diff=max(d for d, _ in run["params"]),
               max_param=max(s for _, s in run["params"]))
    if not use_train_step:   # gradients, compared before the optimizer touches them
        out["max_rel_grad_diff"] = [max_rel(pairs) for pairs in run["grads"]]
    return out


def default_method(make_model, batch, *, steps=3, lr=1e-3):
    """auto_parallel with no method (AutoParallel chooses, maybe a pipeline) beside one
    device: what it chose, the losses, parameters and the collectives of every step."""
    torch.manual_seed(0)
    model = make_model()
    torch.manual_seed(0)
    ref = make_model()
    pm = torchalpa.auto_parallel(model, batch, F.mse_loss,
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=lr))
    run = train_beside_one_device(pm, ref, torch.optim.Adam(ref.parameters(), lr=lr),
                                  lambda step: batch, F.mse_loss, steps=steps,
                                  backward_steps=())
    predicted = sorted([c.kind, c.axis, c.bytes]
                       for c in pm.collectives_per_step(train_step=True))
    from torchalpa.parallel.workflow import default_cluster
    cluster = default_cluster(dist.get_world_size())
    return {"chosen": [n for n in pm.plan.notes if n.startswith("AutoParallel chose")],
            "method": pm.plan.method.get("name"), "mesh_shape": list(pm.plan.mesh_shape),
            "nodes": [cluster.num_nodes, cluster.devices_per_node], "losses": run["losses"],
            "ref_losses": run["ref_losses"], "executed": run["executed"],
            "planned": run["planned"], "predicted": predicted,
            "max_param_diff": max(d for d, _ in run["params"]),
            "max_param": max(s for _, s in run["params"])}


def scenario(name, fn, results):
    results[name] = attempt(fn)


def main():
    out_path, which = sys.argv[1], sys.argv[2].split(",")
    init_distributed()
    n = dist.get_world_size()
    results: dict = {"world_size": n}
    if "megatron" in which:   # Alpa's model-parallel oracle shape, planned with unit costs
        scenario("megatron", lambda: train_and_compare(
            lambda: MLP(256, 6), mlp_inputs(32, 256), cluster=ALPA_UNIT(n)), results)
    if "data_parallel" in which:   # Alpa's data-parallel oracle shape
        scenario("data_parallel", lambda: train_and_compare(
            lambda: MLP(32, 6), mlp_inputs(256, 32), cluster=ALPA_UNIT(n)), results)
    if "data_parallel_train_step" in which:   # the same, by train_step: the loss in the bucket
        scenario("data_parallel_train_step", lambda: train_and_compare(
            lambda: MLP(32, 6), mlp_inputs(256, 32), cluster=ALPA_UNIT(n), use_train_step=True),
            results)
    if "quickstart" in which:     # the default local cluster; plans with RS / AG
        from quickstart import MLP as QuickstartMLP
        scenario("quickstart", lambda: train_and_compare(
            lambda: QuickstartMLP(64, 4), (torch.randn(64, 64), torch.randn(64, 64)),
            use_train_step=True), results)
    if "quickstart_auto" in which:   # what a user gets with no method: AutoParallel
        from quickstart import MLP as QuickstartMLP
        torch.manual_seed(1)            # the same batch on every rank
        batch = (torch.randn(64, 64), torch.randn(64, 64))
        scenario("quickstart_auto", lambda: default_method(lambda: QuickstartMLP(64, 4), batch),
                 results)
    if "custom_op" in which:
        scenario("custom_op", lambda: train_and_compare(
            lambda: WithCustomOp(32), mlp_inputs(16, 32), cluster=ALPA_UNIT(n)), results)
    if "scaled_loss" in which:    # backward from 2 * loss: gradients scale too
        scenario("scaled_loss", lambda: train_and_compare(
            lambda: MLP(64, 3), mlp_inputs(16, 64), scale=2.0, lr=1e-3, steps=2,
            cluster=ALPA_UNIT(n)), results)
    if "mesh_2d" in which and n == 4:
        method = torchalpa.ShardParallel(logical_mesh_shape=(2, 2))
        scenario("mesh_2d", lambda: train_and_compare(
            lambda: MLP(32, 4), mlp_inputs(64, 32), method=method,
            cluster=torchalpa.LogicalMesh(shape=(2, 2), alpha=(1.0, 1.0), beta=(1.0, 0.1))),
            results)
    if "vocab_parallel" in which and n == 4:   # Megatron's embedding: rows split over axis 1
        class Lookup(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Embedding(64, 16, padding_idx=3)
                self.proj = torch.nn.Linear(16, 16)

            def forward(self, x):                          # (B, S) -> (B, S, 16)
                return self.proj(self.embed(x))

        tokens = torch.randint(0, 64, (8, 6), generator=torch.Generator().manual_seed(1))
        tokens[0, :2] = 3                                  # the padding row gets no gradient
        pin = (("embed.weight", (torchalpa.Replicate(), torchalpa.Shard(0))),)
        method = torchalpa.ShardParallel(logical_mesh_shape=(2, 2),
                                         auto_sharding_option=torchalpa.AutoShardingOption(pin=pin))
        scenario("vocab_parallel", lambda: train_and_compare(
            Lookup, (tokens, torch.randn(8, 6, 16, generator=torch.Generator().manual_seed(2))),
            method=method,
            cluster=torchalpa.LogicalMesh(shape=(2, 2), alpha=(1.0, 1.0), beta=(1.0, 0.1))),
            results)
    if "vocab_parallel_loss" in which and n == 4:   # Megatron's vocab-parallel cross entropy
        class TiedLM(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Embedding(64, 16)
                self.mix = torch.nn.Linear(16, 16)

            def forward(self, x):                          # (B, S) -> logits (B, S, 64)
                return torch.tanh(self.mix(self.embed(x))) @ self.embed.weight.T

        def cross_entropy(logits, y):
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

        gen = torch.Generator().manual_seed(4)
        tokens, targets = (torch.randint(0, 64, (8, 6), generator=gen) for _ in range(2))
        # Alpa's 2D search space: the batch on axis 0, the vocabulary on axis 1
        pin = (("embed.weight", (torchalpa.Replicate(), torchalpa.Shard(0))),)
        option = torchalpa.AutoShardingOption(pin=pin, force_batch_dim_to_mesh_dim=0,
                                              allow_mixed_mesh_shape=False)
        scenario("vocab_parallel_loss", lambda: train_and_compare(
            TiedLM, (tokens, targets), loss_fn=cross_entropy,
            method=torchalpa.ShardParallel(logical_mesh_shape=(2, 2), auto_sharding_option=option),
            cluster=torchalpa.LogicalMesh(shape=(2, 2))), results)
    if "softmax_in_steps" in which and n == 4:   # a log-softmax written as max, exp, sum, log
        class Head(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.mix = torch.nn.Linear(16, 16)
                self.head = torch.nn.Linear(16, 256, bias=False)

            def forward(self, x):                          # (B, 16) -> logits (B, 256)
                return self.head(torch.tanh(self.mix(x)))

        def soft_targets_loss(logits, onehot):
            shifted = logits - logits.amax(-1, keepdim=True).detach()
            log_probs = shifted - shifted.exp().sum(-1, keepdim=True).log()
            return -(log_probs * onehot).sum(-1).mean()

        gen = torch.Generator().manual_seed(5)
        x = torch.randn(8, 16, generator=gen)
        onehot = F.one_hot(torch.randint(0, 256, (8,), generator=gen), 256).float()
        method = torchalpa.ShardParallel(auto_sharding_option=torchalpa.AutoShardingOption(
            pin=(("head.weight", (torchalpa.Shard(0),)),)))
        scenario("softmax_in_steps", lambda: train_and_compare(
            Head, (x, onehot), loss_fn=soft_targets_loss, method=method,
            cluster=torchalpa.LogicalMesh(shape=(4,))), results)
    if "attention_heads" in which:   # attention written with matmuls, split by heads
        class HeadAttention(torch.nn.Module):
            def __init__(self, hidden=32, heads=4):
                super().__init__()
                self.heads = heads
                # no key bias: softmax cancels it, so its gradient is rounding noise
                self.q, self.k, self.v = (torch.nn.Linear(hidden, hidden, bias=name != "k")
                                          for name in "qkv")
                self.out = torch.nn.Linear(hidden, hidden)

            def forward(self, x):                          # (B, S, H)
                b, s, h = x.shape

                def split(t):                              # (B, heads, S, H / heads)
                    return t.view(b, s, self.heads, h // self.heads).transpose(1, 2)

                q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
                scores = q @ k.transpose(-1, -2) / (h // self.heads) ** 0.5   # (B, nh, S, S)
                mixed = torch.softmax(scores, -1) @ v                       # (B, nh, S, hd)
                return self.out(mixed.transpose(1, 2).reshape(b, s, h))

        pin = tuple((f"{name}.weight", (torchalpa.Shard(0),)) for name in "qkv") + \
            (("out.weight", (torchalpa.Shard(1),)),)
        method = torchalpa.ShardParallel(auto_sharding_option=torchalpa.AutoShardingOption(pin=pin))
        gen = torch.Generator().manual_seed(3)
        scenario("attention_heads", lambda: train_and_compare(
            HeadAttention, (torch.randn(4, 8, 32, generator=gen), torch.randn(4, 8, 32, generator=gen)),
            method=method, cluster=ALPA_UNIT(n)), results)
    if "fused_qkv" in which:      # nanoGPT's attention: one c_attn, split into q, k, v
        gen = torch.Generator().manual_seed(4)
        scenario("fused_qkv", lambda: train_and_compare(
            FusedAttention, (torch.randn(4, 8, 32, generator=gen),
                             torch.randn(4, 8, 32, generator=gen)),
            method=fused_attention_by_heads(), cluster=ALPA_UNIT(n)), results)
    if "fused_qkv_2d" in which and n == 4:   # heads over axis 1, c_attn's columns over 0
        from torchalpa.core.placement import strided
        pin = (("c_attn.weight", (torchalpa.Shard(1), strided(0, 3))),
               ("c_proj.weight", ("*", torchalpa.Shard(1))))
        method = torchalpa.ShardParallel(
            logical_mesh_shape=(2, 2),
            auto_sharding_option=torchalpa.AutoShardingOption(pin=pin, parameters="sharded"))
        gen = torch.Generator().manual_seed(4)
        scenario("fused_qkv_2d", lambda: train_and_compare(
            FusedAttention, (torch.randn(4, 8, 32, generator=gen),
                             torch.randn(4, 8, 32, generator=gen)),
            method=method, cluster=torchalpa.LogicalMesh(shape=(2, 2))), results)
    if "vit_heads" in which and n == 4:   # timm's qkv.view(B, N, 3, H, D): heads of each
        import torchalpa.models as zoo
        vit = zoo.tiny("vit", batch_size=2, dropout=0.0)
        torch.manual_seed(3)
        # SGD: softmax cancels the key bias, whose gradient is rounding noise that Adam
        # would scale up to a full step
        scenario("vit_heads", lambda: train_and_compare(
            vit.build, vit.example_inputs(), loss_fn=vit.loss_fn, optimizer=torch.optim.SGD,
            lr=1e-2,
            cluster=torchalpa.LogicalMesh(shape=(4,), alpha=(1e-3,), beta=(1e-7,))), results)
    if "hf_gpt2_heads" in which and n == 4:   # transformers' GPT-2: Conv1D c_attn, split
        from torchalpa.models.hf import hf_config, hf_example_batch, hf_loss_fn, hf_model
        config = hf_config("gpt2", n_embd=64, n_head=4, n_layer=2, vocab_size=128,
                           n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        torch.manual_seed(2)
        tokens = hf_example_batch("gpt2", config, 1)
        # latency-cheap, bandwidth-dear links: tensor parallelism beats data parallelism
        scenario("hf_gpt2_heads", lambda: train_and_compare(
            lambda: hf_model("gpt2", config), tokens, loss_fn=hf_loss_fn("gpt2"),
            cluster=torchalpa.LogicalMesh(shape=(4,), alpha=(1e-3,), beta=(1e-7,))), results)
    if "zero3" in which:          # parameters gathered again in backward
        scenario("zero3", lambda: train_and_compare(
            lambda: MLP(32, 4), mlp_inputs(64, 32), method=torchalpa.Zero3Parallel()), results)
    if "odd_batch" in which:      # 30 rows on 4 ranks: planned without splitting the batch
        scenario("odd_batch", lambda: train_and_compare(
            lambda: MLP(32, 3), mlp_inputs(30, 32)), results)
    if "bad_input_shape" in which:
        def bad():
            torch.manual_seed(0)
            pm = torchalpa.auto_parallel(MLP(16, 2), mlp_inputs(8, 16), F.mse_loss,
                                         method=torchalpa.ShardParallel())
            try:
                pm(*mlp_inputs(4, 16))
            except ValueError as e:
                return {"raised": str(e)}
            return {"raised": None}
        scenario("bad_input_shape", bad, results)
    finish(results, out_path)


if __name__ == "__main__":
    main()
