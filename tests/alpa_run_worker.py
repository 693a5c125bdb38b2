"""Run on gloo ranks by tests/test_alpa_runs.py: Alpa's tests of shard parallelism that
*execute* a step and compare with one device, ported to ``torchalpa.auto_parallel``.

Scenarios (argv[2], comma separated):

- ``accum:1x4``, ``accum:2x2``, ``accum_rs:1x4``: Alpa's ``test_gradient_accumulation``.
  Two Dense(16) layers with bias, batch 256 whose row i is all i, target ones, mean squared
  error, 2 micro-batches, momentum SGD (lr 1e-2), all-to-all not allowed, Alpa's unit costs;
  ``accum_rs`` prefers reduce-scatter (Alpa's ``prefer_reduce_scatter``; here
  ``Zero2Parallel``, the method whose plans reduce-scatter gradients).
- ``bert:2x2``: Alpa's ``test_numerical_correctness``: two BERT layers (hidden 256, 8 heads)
  on Alpa's (2, 2) mesh (alpha 2, beta (1, 0.1)), batch 16 x 8, Adam (lr 1e-2), one step.
- ``bert_alpa2d:2x2``: the same in Alpa's 2D search space (the batch on axis 0 alone, no
  dim split over both axes, every gradient in one bucket): the plan that sums the layer
  norms' and row-parallel biases' gradients at half size over axis 0 and all-gathers them
  on axis 1 (tests/test_alpa_shard_parallel.py, test_bert_layer_2d_mesh_total).
- ``bert_rs2d:2x2``: the same with Alpa's space exactly (``slice_before_reduce`` off) and
  ``prefer_reduce_scatter``: the gradients reduce-scattered on axis 0 into parameters
  stored split on both axes, gathered on axis 0 in forward.
- ``mlp_rs2d:2x2``: Alpa's test_n_layer_mlp_2d_mesh_reduce_scatter model (6 Dense(32)
  layers, batch 256) in Alpa's 2D space with ``prefer_reduce_scatter`` and Alpa's
  combined gradients (``all_reduce_threshold`` 2**60), one Adam step (lr 1e-2): the
  column-parallel biases stored as a nested strided shard, like ``bert_rs2d``'s.
- ``mlm2d:2x2``: Alpa's ``test_bert_mlm_2d_mesh`` model and space (tests/
  test_alpa_shard_parallel.py, ``_bert_mlm_2d_plan``), whose plan all-to-alls the head's
  transform weight on axis 1 (a resharding Alpa's space lacks on a 2D mesh), one SGD
  step (lr 1e-2) with both sides' gradients recorded. (Not Adam: its first step moves
  each element by about lr whatever its gradient's size, so elements whose gradient is
  float noise differ by up to lr: measured 0.011 while the gradients agree to 3e-6.)

- ``conv_mixed_rs:2x2``: Alpa's test_n_layer_conv_2d_mesh_mixed_shape_reduce_scatter model
  (4 x (conv, BatchNorm, relu, pool), batch 8, image 32, 8 channels; tests/
  test_alpa_shard_parallel.py, ``_conv_2d_plan``) in Alpa's 2D space with mixed mesh
  shapes and ``prefer_reduce_scatter``, whose third conv weight, stored split on both
  axes, is read through an all-gather on axis 0 and an all-to-all on axis 1; one Adam
  step (lr 1e-2) with both sides' gradients recorded.
- ``accum_prs:1x4``: ``test_gradient_accumulation_reduce_scatter`` with Alpa's own knob,
  ``prefer_reduce_scatter`` on ``ShardParallel`` (``accum_rs`` plans ``Zero2Parallel``).
- ``bert_flat:4x1``: ``test_numerical_correctness`` as Alpa's test runs it: the (2, 2)
  logical mesh it makes is never passed to ``parallelize``, whose default ``ShardParallel``
  plans on the whole machine's mesh flattened (``get_logical_mesh().flatten()``: (4, 1),
  latency (1, 1), inverse bandwidth (0.1, 0.1)); the same model, batch and Adam step.

Alpa's ``prefer_reduce_scatter`` plans (the rewrite after the ILP,
``passes/sharding/gradient_scatter.py``), each one Adam step (lr 1e-2) beside one device:

- ``mlp_rs:1x4``, ``mlp_rs:2x2``: Alpa's MLP with 2 layers (Dense(32), relu, Dense(32);
  batch 256, Alpa's unit costs, Alpa's space: on (2, 2) the batch on axis 0 alone, no
  dim split over both axes, no slice before a sum), ``prefer_reduce_scatter``.
- ``zero3:2x2``: Alpa's ``force_zero_stage_3`` as spelled here on Alpa's 6-layer MLP
  (hidden 32, batch 256): ``force_data_parallel`` (the mesh flattened to 4 devices),
  ``prefer_reduce_scatter`` and ``rematerialize_parameters`` (gathered in forward and
  again in backward).

Each records the plan's collectives (kind, axis, bytes) as a step issues them, the
collectives each step really issued, losses on both sides, and per parameter whether
``torch.allclose(ours, one device's, rtol, atol)`` holds after the step with Alpa's
tolerances (``assert_allclose``'s defaults, 1e-4, for the accumulation test; 5e-4 for
BERT), with the largest difference seen. Rank 0 writes JSON to argv[1].
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(__file__))

from alpa_cases import (  # noqa: E402
    MLP_SPELLINGS,
    BertLayers,
    BertMLM,
    ConvNet,
    mlm_loss,
    mse,
)
from worker_io import mesh_shape, run_scenarios, train_beside_one_device  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.core.placement import short_form  # noqa: E402
from torchalpa.runtime.measurement.issued import issued_collectives  # noqa: E402


class TwoDense(nn.Module):
    """Alpa's gradient-accumulation model: Dense(hidden) twice, with bias."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.first, self.second = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x):
        return self.second(self.first(x))


def _compare(pm, ref, rtol: float, atol: float) -> dict:
    """Per parameter: allclose with Alpa's tolerances, and the largest difference."""
    out = {}
    for (name, p), q in zip(pm.named_parameters(), ref.parameters()):
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = {"allclose": bool(torch.allclose(p.detach(), q.detach(), rtol=rtol,
                                                     atol=atol)),
                     "max_diff": (p - q).abs().max().item(), "max_ref": q.abs().max().item()}
    return out


def _record(pm, run, micro: int, compared: dict) -> dict:
    # what the plan lists for the step as it ran (a train_step's loss may ride a bucket)
    planned = run["planned"][0]
    assert len(issued_collectives(pm.plan, micro)) >= len(planned)
    return {"planned": planned,
            "mesh_shape": list(pm.plan.mesh_shape), "executed": run["executed"],
            "losses": run["losses"], "ref_losses": run["ref_losses"], "params": compared}


def _one_step(build, batch, loss_fn, mesh, method, optimizer, *, micro: int = 1,
              tolerance: float = 5e-4, grads: bool = False, placements=None) -> dict:
    """Build ``build()`` twice alike (seed 0), plan one under ``method`` on ``mesh``, train
    one step beside the other on one device with ``optimizer`` (params -> optimizer), and
    record what ran: planned and issued collectives, losses, parameters compared within
    ``tolerance``; with ``grads`` the first step's gradients, with ``placements`` (a
    placement -> text function) each parameter's layout. Returns the planned model too."""
    torch.manual_seed(0)
    model, ref = build(), build()
    ref.load_state_dict(model.state_dict())
    pm = torchalpa.auto_parallel(model, batch, loss_fn, cluster=mesh, method=method,
                                 num_micro_batches=micro if micro > 1 else None,
                                 optimizer=optimizer)
    run = train_beside_one_device(pm, ref, optimizer(ref.parameters()), lambda step: batch,
                                  loss_fn, steps=1, backward_steps=(0,) if grads else ())
    out = _record(pm, run, micro, _compare(pm, ref, rtol=tolerance, atol=tolerance))
    if grads:
        out["grads"] = run["grads"][0]
    if placements is not None:
        out["placements"] = {p.name: [placements(x) for x in p.placements]
                            for p in pm.plan.parameters}
    return pm, out


def _alpa_2d(**more) -> torchalpa.AutoShardingOption:
    """Alpa's 2D space: the batch on mesh axis 0, no mixed mesh shapes, no reduce-scatter,
    every gradient all-reduced apart."""
    return torchalpa.AutoShardingOption(
        force_batch_dim_to_mesh_dim=0, allow_mixed_mesh_shape=False, allow_reduce_scatter=False,
        all_reduce_threshold=1 << 60, **more)


def _adam(ps):
    return torch.optim.Adam(ps, lr=1e-2)


def _sgd(ps):
    return torch.optim.SGD(ps, lr=1e-2)


def accumulation(shape: tuple[int, ...], reduce_scatter: bool, prefer: bool = False) -> dict:
    batch_size, hidden, micro = 256, 16, 2
    x = torch.ones(batch_size, hidden) * torch.arange(batch_size, dtype=torch.float32)[:, None]
    batch = (x, torch.ones(batch_size, hidden))
    kind = torchalpa.Zero2Parallel if reduce_scatter else torchalpa.ShardParallel
    option = replace(kind().auto_sharding_option, allow_all_to_all=False)
    if not reduce_scatter:      # Alpa's default space has no reduce-scatter (as plan_of)
        option = replace(option, allow_reduce_scatter=False, prefer_reduce_scatter=prefer)
    mesh = torchalpa.LogicalMesh(shape=shape, alpha=(1.0,) * len(shape),
                                 beta=(1.0,) * len(shape))
    return _one_step(lambda: TwoDense(hidden), batch, mse, mesh,
                     kind(logical_mesh_shape=shape, auto_sharding_option=option),
                     lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9), micro=micro,
                     tolerance=1e-4)[1]


def bert(shape: tuple[int, ...], alpa_2d: bool = False, reduce_scatter: bool = False,
         flattened: bool = False) -> dict:
    batch_size, seq, hidden, heads = 16, 8, 256, 8
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(batch_size, seq, hidden, generator=g),
             torch.ones(batch_size, seq, dtype=torch.int64),
             torch.randn(batch_size, seq, hidden, generator=g))
    mesh = torchalpa.LogicalMesh(shape=shape, alpha=(2.0,) * len(shape), beta=(1.0, 0.1))
    if flattened:       # Alpa's default mesh flattened: (1, 1) latency, (0.1, 0.1) bandwidth
        mesh = torchalpa.LogicalMesh(shape=shape, alpha=(1.0, 1.0), beta=(0.1, 0.1))
    option = _alpa_2d() if alpa_2d else torchalpa.AutoShardingOption()
    if reduce_scatter:      # Alpa's space exactly, and its rewrite after the ILP
        option = replace(option, slice_before_reduce=False, prefer_reduce_scatter=True)
    return _one_step(lambda: BertLayers(2, hidden, heads), batch, mse, mesh,
                     torchalpa.ShardParallel(logical_mesh_shape=shape,
                                             auto_sharding_option=option),
                     _adam, placements=short_form)[1]


def mlp_rs_2d(shape: tuple[int, ...]) -> dict:
    """Alpa's 2D MLP (tests/test_alpa_shard_parallel.py, ``_mlp_2d_plan``) with
    ``prefer_reduce_scatter``, one Adam step beside one device."""
    batch_size, hidden = 256, 32
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(batch_size, hidden, generator=g),
             torch.randn(batch_size, hidden, generator=g))
    mesh = torchalpa.LogicalMesh(shape=shape, beta=(1.0, 0.1))
    option = _alpa_2d(slice_before_reduce=False, prefer_reduce_scatter=True)
    pm, out = _one_step(lambda: MLP_SPELLINGS["modulelist"](6, hidden, hidden, hidden), batch,
                        mse, mesh, torchalpa.ShardParallel(logical_mesh_shape=shape,
                                                           auto_sharding_option=option),
                        _adam, placements=short_form)
    # each parameter's Adam moments: their layout, and the elements this rank holds
    out["states"] = {name: {k: [[short_form(x) for x in v.placements], v.to_local().numel()]
                            for k, v in pm.optimizer.state[p].items()
                            if hasattr(v, "placements")}
                     for name, p in pm.module.named_parameters()}
    return out


def mlm_2d(shape: tuple[int, ...]) -> dict:
    """Alpa's test_bert_mlm_2d_mesh: its model, mesh costs and options (as
    ``_bert_mlm_2d_plan``), trained one SGD step beside one device."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 4096, (4, 4), generator=g)
    batch = (ids, torch.ones(4, 4, dtype=torch.int64), torch.zeros(4, 4, dtype=torch.int64),
             torch.arange(4).repeat(4, 1), torch.randint(0, 4096, (4, 4), generator=g))
    mesh = torchalpa.LogicalMesh(shape=shape, alpha=(2.0,) * len(shape), beta=(1.0, 0.1))
    option = _alpa_2d(slice_before_reduce=False, allow_recompute_heavy_op=True,
                      allow_all_gather=False)
    pm, out = _one_step(lambda: BertMLM(2, 512, 4, 4096, 4), batch, mlm_loss, mesh,
                        torchalpa.ShardParallel(logical_mesh_shape=shape,
                                                auto_sharding_option=option),
                        _sgd, grads=True, placements=short_form)
    out["all_to_all"] = [[c.tensor, c.source, c.axis] for c in pm.plan.collectives
                         if c.kind == "all_to_all"]
    return out


def conv_mixed_rs(shape: tuple[int, ...]) -> dict:
    """Alpa's conv net on (2, 2) with mixed mesh shapes and ``prefer_reduce_scatter``
    (module docstring), one Adam step beside one device (BatchNorm in training mode,
    synchronized over the devices splitting the batch)."""
    num_layers, batch_size, image, channel = 4, 8, 32, 8
    g = torch.Generator().manual_seed(0)
    out = image // 2 ** num_layers
    batch = (torch.randn(batch_size, channel, image, image, generator=g),
             torch.randn(batch_size, channel, out, out, generator=g))
    mesh = torchalpa.LogicalMesh(shape=shape, beta=(1.0, 0.1))
    option = torchalpa.AutoShardingOption(
        force_batch_dim_to_mesh_dim=0, allow_mixed_mesh_shape=True, slice_before_reduce=False,
        allow_reduce_scatter=False, all_reduce_threshold=1 << 60, prefer_reduce_scatter=True)
    pm, out = _one_step(lambda: ConvNet(num_layers, channel), batch, mse, mesh,
                        torchalpa.ShardParallel(logical_mesh_shape=shape,
                                                auto_sharding_option=option),
                        _adam, grads=True, placements=short_form)
    out["all_to_all"] = [[c.tensor, c.source, c.axis] for c in pm.plan.collectives
                         if c.kind == "all_to_all"]
    return out


def mlp_prefer_reduce_scatter(shape: tuple[int, ...], zero3: bool = False) -> dict:
    """Alpa's MLP (``MLPModuleList``) under ``prefer_reduce_scatter``: 2 layers in Alpa's
    space, or Alpa's 6 layers spelled as its ZeRO-3 (module docstring); one Adam step."""
    from alpa_cases import MLPModuleList
    num_layers, batch_size, hidden = (6, 256, 32) if zero3 else (2, 256, 32)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(batch_size, hidden, generator=g),
             torch.randn(batch_size, hidden, generator=g))
    mesh = torchalpa.LogicalMesh(shape=shape, alpha=(1.0,) * len(shape),
                                 beta=(1.0,) * len(shape))
    option = torchalpa.AutoShardingOption(allow_reduce_scatter=False,
                                          all_reduce_threshold=1 << 60,
                                          prefer_reduce_scatter=True)
    if zero3:
        option = replace(option, force_data_parallel=True, rematerialize_parameters=True)
    elif len(shape) == 2 and min(shape) > 1:        # Alpa's 2D space
        option = replace(option, force_batch_dim_to_mesh_dim=0, allow_mixed_mesh_shape=False,
                         slice_before_reduce=False)
    return _one_step(lambda: MLPModuleList(num_layers, hidden, hidden, hidden), batch, mse,
                     mesh, torchalpa.ShardParallel(logical_mesh_shape=shape,
                                                   auto_sharding_option=option),
                     _adam, grads=True, placements=str)[1]


SCENARIOS = {"mlm2d": mlm_2d, "accum": lambda s: accumulation(s, False),
             "accum_rs": lambda s: accumulation(s, True), "bert": bert,
             "bert_alpa2d": lambda s: bert(s, alpa_2d=True),
             "bert_rs2d": lambda s: bert(s, alpa_2d=True, reduce_scatter=True),
             "mlp_rs2d": mlp_rs_2d, "conv_mixed_rs": conv_mixed_rs,
             "bert_flat": lambda s: bert(s, flattened=True),
             "accum_prs": lambda s: accumulation(s, False, prefer=True),
             "mlp_rs": mlp_prefer_reduce_scatter,
             "zero3": lambda s: mlp_prefer_reduce_scatter(s, zero3=True)}


def main():
    run_scenarios(lambda name, shape: SCENARIOS[name](mesh_shape(shape)))


if __name__ == "__main__":
    main()
