"""Run under torchrun by tests/test_pipeline.py: pipelined training on real gloo ranks
against single-device training with the same global batch. Rank 0 writes JSON."""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from worker_io import named_input_faults, run_listed_scenarios  # noqa: E402

import torchalpa  # noqa: E402
import torchalpa.models as zoo  # noqa: E402


def compare(make_model, batch, loss_fn, method, *, cluster=None, steps=3, lr=1e-3,
            use_backward=False, options=None):
    from torch._dynamo.utils import counters
    counters.clear()
    torch.manual_seed(0)
    model = make_model()
    torch.manual_seed(0)
    ref = make_model()
    pm = torchalpa.auto_parallel(model, batch, loss_fn, method=method, cluster=cluster,
                                 optimizer=lambda ps: torch.optim.Adam(ps, lr=lr),
                                 **(options or {}))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=lr)
    replays = _count_replays(pm._runner)
    out = {"losses": [], "ref_losses": [], "stages": pm.plan.forward_stage_layer_ids,
           "submeshes": [list(s) for s in pm.plan.submesh_shapes],
           "logical": [list(s) for s in pm.plan.logical_shapes],
           "stage_times": pm.plan.estimates.stage_times,
           "stage_step_s": pm.plan.estimates.stage_step_s,
           "remat": pm.plan.method.get("remat"), "notes": list(pm.plan.notes),
           "recompute": [st.recompute for st in pm.plan.stages]}
    for step in range(steps):
        counting = _count_sends() if step == 0 else None
        if use_backward:
            loss = pm(*batch)
            loss.backward()
            pm.optimizer.step()
            pm.optimizer.zero_grad(set_to_none=True)
        else:
            loss = pm.train_step(*batch)
        if counting is not None:
            out["sent_bytes"] = counting.stop()
            def planned(size):
                return sum(size(t) * len(pm.plan.stages[t.dst_stage].ranks) *
                           (1 if t.once_per_step else pm.plan.num_micro_batches)
                           for t in pm.plan.transfers)
            out["planned_bytes"] = planned(lambda t: t.bytes_per_receiver())
            out["whole_bytes"] = planned(lambda t: t.bytes)     # were none split
            out["split"] = [t.split for t in pm.plan.transfers]
            out["batch_split"] = [getattr(t, "batch_split", 1) for t in pm.plan.transfers]
            out["once_bytes"] = sum(t.bytes_per_receiver() * len(pm.plan.stages[t.dst_stage].ranks)
                                    for t in pm.plan.transfers if t.once_per_step)
            out["once_per_step"] = sum(t.once_per_step for t in pm.plan.transfers)
        ref_loss = loss_fn(ref(*batch[:-1]), batch[-1])
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        out["losses"].append(loss.item())
        out["ref_losses"].append(ref_loss.item())
    # every stage's parameters against the reference (gathered on their stage's ranks)
    diffs = []
    for (name, p), q in zip(pm.module.named_parameters(), ref.parameters()):
        if p.to_local().numel() or dist.get_rank() in _stage_ranks(pm.plan, name):
            full = p.full_tensor() if dist.get_rank() in _stage_ranks(pm.plan, name) else None
            if full is not None:
                diffs.append((full - q).abs().max().item())
    worst = torch.tensor(max(diffs) if diffs else 0.0)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    out["max_param_diff"] = worst.item()
    ran = torch.tensor(replays[0])
    dist.all_reduce(ran)
    out["replays"] = int(ran.item())    # forwards run again by recomputed stages, all ranks
    out["num_micro_batches"] = pm.plan.num_micro_batches
    # ranks whose stage gathers its parameters once per step, before the first micro-batch
    once = torch.tensor(int(pm._runner.program.param_gathers is not None))
    dist.all_reduce(once)
    out["ranks_gathering_once"] = int(once.item())
    out["compiled"] = "compiled with torch.compile" in pm.local_program()
    graphs = torch.tensor(counters["stats"]["unique_graphs"])   # dynamo's, on each rank
    dist.all_reduce(graphs, op=dist.ReduceOp.MIN)
    out["fewest_compiled_graphs"] = int(graphs.item())
    return out


def auto_on_this_job(make_model, batch) -> dict:
    """The default method on the cluster this job runs on (torchrun's node layout): what
    it chose, the node layout it saw, and training beside one device."""
    from torchalpa.parallel.workflow import default_cluster
    out = compare(make_model, batch, F.mse_loss, torchalpa.AutoParallel(time_budget_s=5))
    cluster = default_cluster(dist.get_world_size())
    return {**out, "nodes": [cluster.num_nodes, cluster.devices_per_node]}


def _count_replays(runner) -> list[int]:
    """Counts the forwards a recomputed stage runs again (``StepRunner._replay``)."""
    count, replay = [0], runner._replay

    def counted(*args):
        count[0] += 1
        return replay(*args)
    runner._replay = counted
    return count


def checkpoint_round_trip(make_model, batch, loss_fn, method, *, cluster, path):
    """Train, save, train on; a fresh pipelined model loads the checkpoint and must train
    on with the very same losses (model and optimizer restored bit-identically)."""
    def build(seed):
        torch.manual_seed(seed)
        return torchalpa.auto_parallel(make_model(), batch, loss_fn, method=method,
                                       cluster=cluster,
                                       optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    pm = build(0)
    pm.train_step(*batch)
    torchalpa.save_checkpoint(path, pm)
    after = [pm.train_step(*batch).item() for _ in range(2)]
    fresh = build(1)                     # other weights, until the checkpoint is loaded
    different = fresh.train_step(*batch).item()
    fresh = build(1)
    torchalpa.load_checkpoint(path, fresh)
    resumed = [fresh.train_step(*batch).item() for _ in range(2)]
    return {"after": after, "resumed": resumed, "different": different}


def export(make_model, batch, loss_fn, method, *, cluster, path):
    """Out of a pipeline: after a step, unwrap() on every rank and save_pretrained (rank 0
    writes) hold every stage's trained tensors, tied ones once; generate() refuses,
    naming unwrap."""
    torch.manual_seed(0)
    pm = torchalpa.auto_parallel(make_model(), batch, loss_fn, method=method, cluster=cluster,
                                 optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    torch.manual_seed(0)
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    pm.train_step(*batch)
    loss_fn(ref(*batch[:-1]), batch[-1]).backward()
    ref_opt.step()
    plain = pm.unwrap()
    refs = dict(ref.named_parameters())
    out = {"stages": len(pm.plan.stages),
           "dtensors": sum(type(p).__name__ == "DTensor" for p in plain.parameters()),
           "unwrap_diff": max((p - refs[n]).abs().max().item()
                              for n, p in plain.named_parameters()),
           "moved": max((p - q).abs().max().item()             # the step did change them
                        for p, q in zip(plain.parameters(), make_model_at(make_model, 0)))}
    with torch.no_grad():
        out["output_diff"] = (plain(*batch[:-1]) - ref(*batch[:-1])).abs().max().item()
    # what each rank allocates while saving: only the writer (rank 0) holds the whole model
    from torchalpa.runtime.measurement.allocated import peak_allocated
    peak = peak_allocated(lambda: torchalpa.save_pretrained(pm, path)).peak
    out["save_peaks"] = [None] * dist.get_world_size()
    dist.all_gather_object(out["save_peaks"], peak)
    out["model_bytes"] = sum(t.numel() * t.element_size() for t in
                             {id(t): t for t in [*plain.parameters(), *plain.buffers()]}.values())
    from safetensors.torch import load_file
    saved = load_file(os.path.join(path, "model.safetensors"))
    state = ref.state_dict()          # both names of the tied weight
    out["saved"], out["parameters"] = len(saved), len(refs)
    out["unknown_saved"] = sorted(set(saved) - set(state))
    out["tied_kept"] = plain.lm_head.weight is plain.wte.weight
    out["saved_diff"] = max((t - state[n]).abs().max().item() for n, t in saved.items()
                            if n in state)
    try:
        pm.generate(batch[0])
        out["generate"] = None
    except ValueError as e:
        out["generate"] = str(e)
    everyone: list = [None] * dist.get_world_size()    # each rank's own view, worst kept
    dist.all_gather_object(everyone, out["unwrap_diff"])
    out["unwrap_diff"] = max(everyone)
    return out


def make_model_at(make_model, seed):
    """The parameters ``make_model`` starts from under ``seed``."""
    torch.manual_seed(seed)
    return list(make_model().parameters())


class _count_sends:
    """Bytes every rank hands to dist.isend until stop() (summed over ranks)."""

    def __init__(self):
        self.original, self.sent = dist.isend, 0

        def isend(tensor, *args, **kwargs):
            self.sent += tensor.numel() * tensor.element_size()
            return self.original(tensor, *args, **kwargs)
        dist.isend = isend

    def stop(self) -> int:
        dist.isend = self.original
        total = torch.tensor(self.sent, dtype=torch.int64)
        dist.all_reduce(total)
        return int(total.item())


def checks(method, cluster):
    """check_inputs / check_replicas under PipeshardParallel, as for ShardParallel: rank 3
    (the last stage) passes a batch of the right shape but other values, named on the
    first call by default, on every call with "always", never with "never"; a random call
    on rank 1 only drifts its stage's generator, named on every rank by check_replicas."""
    from torchalpa.runtime.resilience.replicas import ReplicaMismatchError

    def build(mode):
        torch.manual_seed(0)
        return torchalpa.auto_parallel(mlp()(), mlp_batch(), F.mse_loss, method=method,
                                       cluster=cluster, check_inputs=mode,
                                       check_replicas=mode == "always")
    out, modules = named_input_faults(build, mlp_batch, bad_rank=3,
                                      corrupt=lambda xy: (xy[0], xy[1] + 1.0))
    pm = modules["always"]                   # agree, step, then drift rank 1's generator
    torch.manual_seed(0)
    with torch.no_grad():
        pm(*mlp_batch())
    if dist.get_rank() == 1:
        torch.rand(3)
    try:
        with torch.no_grad():
            pm(*mlp_batch())
        out["replicas"] = None
    except ReplicaMismatchError as e:
        out["replicas"] = str(e)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, out["replicas"] is not None)
    out["replica_error_on"] = [r for r, raised in enumerate(everyone) if raised]
    return out


def _stage_ranks(plan, name):
    for s in plan.stages:
        if any(p.name == name for p in s.plan.parameters):
            return s.ranks
    return ()


def mlp(dim=64, layers=4):
    from quickstart import MLP
    return lambda: MLP(dim, layers)


def mlp_batch(batch=32, dim=64):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, dim, generator=g), torch.randn(batch, dim, generator=g)


def cast_tied_gpt(gpt):
    """``gpt``'s GPT with float64 master weights computing in float32 (a ``CastForward``
    on each block and each other top-level module, as mixed precision casts per module):
    its tied embedding is cast in the first stage and again in the head's, so the head's
    stage sends back a gradient part it could reduce narrow with every micro-batch."""
    from torchalpa.runtime.execution.precision import CastForward
    policy = torchalpa.MixedPrecision(param_dtype=torch.float32, output_dtype=None)

    def build():
        model = gpt.build().double()
        for i, block in enumerate(model.h):
            model.h[i] = CastForward(block, policy)
        for name in ("wte", "wpe", "ln_f", "lm_head"):
            setattr(model, name, CastForward(getattr(model, name), policy))
        return model
    return build


def all_reduces_per_micro_batch(make_model, batch, loss_fn, method, cluster) -> dict:
    """Training beside one device (``compare``), and the all-reduces this rank issues in
    a step (after the first) with ``method``'s micro-batches and with half of them:
    the difference over the micro-batches taken away is what each micro-batch
    all-reduces (its count and bytes, worst rank)."""
    from dataclasses import replace as dc_replace

    from torchalpa.runtime.measurement.traffic import TALLY
    out = {}
    for k in (method.num_micro_batches, method.num_micro_batches // 2):
        torch.manual_seed(0)
        pm = torchalpa.auto_parallel(make_model(), batch, loss_fn,
                                     method=dc_replace(method, num_micro_batches=k),
                                     cluster=cluster,
                                     optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3))
        pm.train_step(*batch)
        before = TALLY.copy()
        pm.train_step(*batch)
        step = TALLY.since(before)
        out[k] = (step.count["all_reduce"], step.sent["all_reduce"])
    half = method.num_micro_batches // 2
    per_micro = torch.tensor([(out[2 * half][i] - out[half][i]) / half for i in range(2)])
    dist.all_reduce(per_micro, op=dist.ReduceOp.MAX)
    result = compare(make_model, batch, loss_fn, method, cluster=cluster)
    result["all_reduces_per_micro_batch"], result["all_reduce_bytes_per_micro_batch"] = \
        per_micro.tolist()
    result["all_reduces_per_step"] = out[2 * half][0]
    # the tied weight's gradient in the compute dtype (float32), as each micro-batch
    # would reduce it before it is summed
    result["tied_bytes"] = make_model().wte.weight.numel() * 4
    return result


def manual(ids, submeshes, logical=None, recompute=None, options=None):
    return torchalpa.ManualStageOption(forward_stage_layer_ids=ids, submesh_shapes=submeshes,
                                       logical_shapes=logical, recompute=recompute,
                                       options=options)


def scenarios(n):
    P, L = torchalpa.PipeshardParallel, torchalpa.AutoLayerOption
    gpt = zoo.tiny("gpt", batch_size=8, dropout=0.0, num_layers=4)
    torch.manual_seed(1234)                 # the same global batch on every rank
    gpt_batch = gpt.example_inputs()
    cpu = torchalpa.Cluster.local_cpu(n)
    if n == 4:
        yield "mlp_2x2_1f1b", lambda: compare(mlp(), mlp_batch(), F.mse_loss, P(
            num_micro_batches=4, layer_option=L(layer_num=4),
            stage_option=manual([[0, 1], [2, 3]], [(1, 2), (1, 2)])), cluster=cpu)
        # auto_parallel's own options: the micro-batch count given there, compiled stages
        yield "mlp_2x2_options", lambda: compare(mlp(), mlp_batch(), F.mse_loss, P(
            layer_option=L(layer_num=4), stage_option=manual([[0, 1], [2, 3]], [(1, 2)] * 2)),
            cluster=cpu, options=dict(num_micro_batches=4, compile={"backend": "aot_eager"}))
        yield "mlp_2x2_checks", lambda: checks(P(
            num_micro_batches=2, layer_option=L(layer_num=4),
            stage_option=manual([[0, 1], [2, 3]], [(1, 2), (1, 2)])), cpu)
        yield "mlp_4x1_gpipe_backward", lambda: compare(mlp(), mlp_batch(), F.mse_loss, P(
            num_micro_batches=8, pipeline_schedule="gpipe", layer_option=L(layer_num=4),
            stage_option=manual([[0], [1], [2], [3]], [(1, 1)] * 4)), cluster=cpu,
            use_backward=True)
        yield "mlp_auto_pipeline", lambda: compare(
            mlp(), mlp_batch(), F.mse_loss,
            torchalpa.AutoParallel(pipeline=True, remat=("none",), time_budget_s=1),
            cluster=cpu)
        yield "mlp_auto_nodes", lambda: auto_on_this_job(mlp(), mlp_batch())
        # mixed precision cast per module: the tied embedding's gradient part the head's
        # stage sends back is summed over the micro-batches and reduced once per step
        yield "gpt_2x2_cast_tied", lambda: all_reduces_per_micro_batch(
            cast_tied_gpt(gpt), gpt_batch, gpt.loss_fn, P(
                num_micro_batches=4, layer_option=L(layer_num=2),
                stage_option=manual([[0], [1]], [(1, 2), (1, 2)])), cpu)
        # the same, each stage's ILP solved simplified (as a stage too large for the
        # unsimplified re-solves is: BLOOM-176B's): the embedding's stage adds the summed
        # part it receives to its own part, a partial sum it reduces once per step
        simplified = torchalpa.AutoShardingOption(force_batch_dim_to_mesh_dim=0,
                                                  free_followers_below=0, exact_below=0)
        yield "gpt_2x2_cast_tied_simplified", lambda: all_reduces_per_micro_batch(
            cast_tied_gpt(gpt), gpt_batch, gpt.loss_fn, P(
                num_micro_batches=4, layer_option=L(layer_num=2),
                stage_option=manual([[0], [1]], [(1, 2), (1, 2)],
                                    options=[simplified] * 2)), cpu)
        yield "gpt_2x2_1f1b", lambda: compare(gpt.build, gpt_batch, gpt.loss_fn, P(
            num_micro_batches=4, layer_option=L(layer_num=2),
            stage_option=manual([[0], [1]], [(1, 2), (1, 2)])), cluster=cpu)
        # stage 0 checkpointed (keeps only its inputs, runs forward again before backward),
        # stage 1 not: trains like one device all the same
        yield "gpt_2x2_recompute", lambda: compare(gpt.build, gpt_batch, gpt.loss_fn, P(
            num_micro_batches=4, layer_option=L(layer_num=2),
            stage_option=manual([[0], [1]], [(1, 2), (1, 2)], recompute=[True, False])),
            cluster=cpu)
        # ZeRO-2 inside the stages (parameters sharded over each stage's 2 ranks): each
        # stage gathers its parameters once per step, before its first micro-batch; stage 0
        # checkpointed, so its replayed forwards read the same gathered copies. Two nodes
        # of 2 ranks, one stage each, the link between them 100x slower than inside a
        # node: each activation (and its gradient) crosses in 2 chunks, one to each rank
        # of the receiving stage, which all-gather them (scatter-gather)
        zero = torchalpa.AutoShardingOption(force_batch_dim_to_mesh_dim=0,
                                            parameters="sharded")
        two_nodes = dataclasses.replace(cpu, num_nodes=2, devices_per_node=2,
                                        inter_node_bandwidth=cpu.intra_node_bandwidth / 100)
        yield "gpt_2x2_zero_scatter", lambda: compare(gpt.build, gpt_batch, gpt.loss_fn, P(
            num_micro_batches=4, layer_option=L(layer_num=2), auto_sharding_option=zero,
            stage_option=manual([[0], [1]], [(1, 2), (1, 2)], recompute=[True, False])),
            cluster=two_nodes)
        yield "gpt_auto", lambda: compare(gpt.build, gpt_batch, gpt.loss_fn, P(
            num_micro_batches=4, layer_option=L(layer_num=4)), cluster=cpu)
        yield "gpt_profile", lambda: compare(gpt.build, gpt_batch, gpt.loss_fn, P(
            num_micro_batches=4, layer_option=L(layer_num=4), stage_option="profile"),
            cluster=cpu)
        yield "gpt_checkpoint", lambda: checkpoint_round_trip(gpt.build, gpt_batch, gpt.loss_fn, P(
            num_micro_batches=4, layer_option=L(layer_num=2),
            stage_option=manual([[0], [1]], [(1, 2), (1, 2)])), cluster=cpu,
            path=os.path.join(os.path.dirname(sys.argv[1]), "pipeline_ckpt"))
        yield "gpt_2x2_export", lambda: export(gpt.build, gpt_batch, gpt.loss_fn, P(
            num_micro_batches=2, layer_option=L(layer_num=2),
            stage_option=manual([[0], [1]], [(1, 2), (1, 2)])), cluster=cpu,
            path=os.path.join(os.path.dirname(sys.argv[1]), "pipeline_export"))
    if n == 8:
        # two nodes of 4, the link between them 100x slower: the activation crosses with
        # its batch split over dp, each block scatter-gathered over tp (GPT-76B's layout)
        eight = torchalpa.Cluster.local_cpu(8)
        two_nodes = dataclasses.replace(eight, num_nodes=2, devices_per_node=4,
                                        inter_node_bandwidth=eight.intra_node_bandwidth / 100)
        yield "gpt_2x2x2_1f1b", lambda: compare(gpt.build, gpt_batch, gpt.loss_fn, P(
            num_micro_batches=4, layer_option=L(layer_num=2),
            stage_option=manual([[0], [1]], [(1, 4), (1, 4)], [(2, 2), (2, 2)])),
            cluster=two_nodes)
        # checkpointing on stages of 2x2 logical meshes: stage 0 recomputes its forward
        # before each backward, stage 1 keeps its activations (issue 15, item 5)
        yield "gpt_2x2x2_recompute", lambda: compare(gpt.build, gpt_batch, gpt.loss_fn, P(
            num_micro_batches=4, layer_option=L(layer_num=2),
            stage_option=manual([[0], [1]], [(1, 4), (1, 4)], [(2, 2), (2, 2)],
                                recompute=[True, False])),
            cluster=torchalpa.Cluster.local_cpu(8))
        yield "mlp_2x2x2_gpipe", lambda: compare(mlp(), mlp_batch(), F.mse_loss, P(
            num_micro_batches=4, pipeline_schedule="gpipe", layer_option=L(layer_num=4),
            stage_option=manual([[0, 1], [2, 3]], [(1, 4), (1, 4)], [(2, 2), (2, 2)])),
            cluster=torchalpa.Cluster.local_cpu(8))


def main():
    run_listed_scenarios(scenarios)


if __name__ == "__main__":
    main()
