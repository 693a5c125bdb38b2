"""Run on gloo ranks by tests/test_seq_parallel.py: a zoo GPT (layer norm) and a zoo LLaMA
(RMS norm written out) on a 1-D tensor-parallel mesh, Megatron's column / row styles
pinned and ``sequence_parallel=True``, trained beside the same model on one device. Rank 0
writes what it saw as JSON to argv[1]; argv[2] lists the scenarios (``gpt:4``,
``llama:4``: model and number of ranks; ``gpt-kept:4``: the GPT planned without
Megatron's gathering again in backward, so forward views that backward reads may keep
their gathered copies).

Records: the layouts of the norms' outputs, the gathered copies forward views keep, the
collective kinds of the plan, the losses of 3 Adam steps on both sides, the first step's
gradients and the parameters after the last, and each step's collectives next to the
plan's.
"""

from __future__ import annotations

import os
import sys

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

sys.path.insert(0, os.path.dirname(__file__))

from worker_io import max_rel, run_scenarios, train_beside_one_device  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.models import gpt, llama  # noqa: E402

COL, ROW = ColwiseParallel(), RowwiseParallel()
STYLES = {
    "gpt": {"h.*.attn.c_attn": COL, "h.*.attn.c_proj": ROW,
            "h.*.mlp.c_fc": COL, "h.*.mlp.c_proj": ROW},
    "llama": {"layers.*.self_attn.q_proj": COL, "layers.*.self_attn.k_proj": COL,
              "layers.*.self_attn.v_proj": COL, "layers.*.self_attn.o_proj": ROW,
              "layers.*.mlp.gate_proj": COL, "layers.*.mlp.up_proj": COL,
              "layers.*.mlp.down_proj": ROW},
}
BATCH, SEQ = 2, 16      # a batch of 2 does not split over 4 ranks: tokens split by sequence


def make(name: str):
    if name == "gpt":
        config = gpt.GPTConfig.tiny(num_heads=4, dropout=0.0)
        return config, lambda: gpt.GPT(config), gpt
    config = llama.LlamaConfig.tiny(num_kv_heads=4)
    return config, lambda: llama.Llama(config), llama


def batch_of(module, config, step: int):
    torch.manual_seed(100 + step)
    return module.example_batch(config, BATCH, seq_len=SEQ)


def keeping_gathered_views():
    """Plan with sequence-parallel norms but without Megatron's gathering again in
    backward: the forward views backward reads (the column-parallel products' inputs) may
    keep the gathered copy, priced by ``passes/pricing/gathered_views.py``."""
    from torchalpa.passes.sharding import intra_op
    from torchalpa.passes.sharding.costgraph import REGATHER_SAVED_VIEWS
    os.environ["TORCHALPA_CACHE"] = "0"       # the cache's key does not see this
    rule = intra_op.forbidden_collectives
    intra_op.forbidden_collectives = lambda option: rule(option) - {REGATHER_SAVED_VIEWS}


def gathered_saved_views(pm, model, batch, loss_fn) -> int:
    """Operand reads of forward views that backward reads, in a larger layout than their
    operand's: the gathered copies the plan keeps for backward."""
    from torchalpa.frontends.torch_export import capture
    from torchalpa.passes.pricing.gathered_views import saved_view_spans
    from torchalpa.passes.sharding.reshard import local_bytes
    graph = capture(model, batch, loss_fn).graph
    plan, mesh = pm.plan, pm.plan.mesh_shape
    views = {s.view for s in saved_view_spans(graph)}
    return sum(1 for r in plan.reshards if r.consumer in views and r.slot == 0
               and local_bytes(graph.node(r.producer).outputs[r.index],
                               plan.strategy(r.consumer).inputs[0], mesh) >
               local_bytes(graph.node(r.producer).outputs[r.index],
                           plan.strategy(r.producer).outputs[r.index], mesh))


def run(name: str, ranks: str) -> dict:
    tp = int(ranks)
    kept = name.endswith("-kept")
    if kept:
        keeping_gathered_views()
        name = name.removesuffix("-kept")
    config, build, module = make(name)
    torch.manual_seed(0)
    model = build()
    torch.manual_seed(0)
    ref = build()
    option = torchalpa.AutoShardingOption(pin=STYLES[name], sequence_parallel=True)
    pm = torchalpa.auto_parallel(
        model, batch_of(module, config, 0), module.loss_fn,
        method=torchalpa.ShardParallel(logical_mesh_shape=(tp,), auto_sharding_option=option),
        # priced as H100s: elementwise work split by sequence pays, and a reduce-scatter
        # costs half an all-reduce (on gloo it costs one, so a plan may as well all-reduce
        # and slice); gloo runs the plan all the same
        cluster=torchalpa.Cluster.h100(devices_per_node=tp),
        optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
    run = train_beside_one_device(pm, ref, torch.optim.Adam(ref.parameters(), lr=1e-3),
                                  lambda step: batch_of(module, config, step), module.loss_fn,
                                  steps=3)
    # the norms' statistics: layer norm's own op, RMS norm's written-out mean (B, S, 1)
    norms = {s.node: str(s.outputs[0]) for s in pm.plan.strategies
             if s.node.split("_")[0] in ("native", "mean") and "backward" not in s.node
             and (s.node.startswith("native_layer_norm") or s.node.startswith("mean"))}
    return {"norms": norms, "gathered_saved_views": gathered_saved_views(
                pm, build(), batch_of(module, config, 0), module.loss_fn),
            "kinds": sorted({c.kind for c in pm.plan.collectives}),
            "executed": run["executed"], "planned_per_step": run["planned"],
            "losses": run["losses"], "ref_losses": run["ref_losses"],
            "grad_rel_diff": max_rel(run["grads"][0]),
            "param_diffs": {n: d / max(s, 1e-12) for (n, _), (d, s)
                            in zip(ref.named_parameters(), run["params"], strict=True)}}


def main():
    run_scenarios(run)


if __name__ == "__main__":
    main()
