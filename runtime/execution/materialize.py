"""Parameters and buffers as DTensors with the planned placements, from real or meta weights.

Real weights are distributed from rank 0 (like DDP's initial broadcast). A model built on
the ``meta`` device (too big for one rank) gets only this rank's blocks allocated, then
initialized in place on the DTensors by ``init_weights(module)`` -- by default
``reset_parameters()`` on every submodule that has one, as after FSDP2's ``to_empty``.

On CPU meshes DTensor has no distributed random-number tracker: every rank would draw the
same numbers for its own block, so all blocks of a sharded parameter would be equal. While
``init_weights`` runs, random fills of sharded DTensors therefore draw from a generator
seeded by (a seed shared by all ranks, the call's position, the block's index), so blocks
differ, replicas agree, and no rank ever builds a whole sharded parameter. The values are
not those single-device initialization draws with the same seed, but have the same
distribution. Replicated dims are made equal across ranks afterwards (a broadcast from
the first rank of each mesh axis) in case ``init_weights`` draws differently per rank.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from torchalpa.core import placement as P
from torchalpa.core.plan import Plan

__all__ = ["to_dtensor_placements", "distribute_module_state", "distribute_stages", "local_zeros",
           "reset_parameters", "MaterializeWarning", "StridedGatherWarning",
           "stacked_strided_names"]


class MaterializeWarning(UserWarning):
    """A meta parameter or buffer that ``init_weights`` left as zeros."""


class StridedGatherWarning(UserWarning):
    """Parameters held as stacked strided shards, which ``DTensor.full_tensor`` gathers
    wrong (PyTorch 2.13): read them whole with ``torchalpa.full_tensor``."""


def to_dtensor_placements(placements) -> tuple:
    out = []
    for p in placements:
        if P.split_factor_of(p) > 1:
            out.append(p)   # torch's _StridedShard already
        elif isinstance(p, P.Shard):
            out.append(Shard(p.dim))
        elif isinstance(p, P.Replicate):
            out.append(Replicate())
        else:
            out.append(Partial(p.reduce_op))
    return tuple(out)


def reset_parameters(module: nn.Module) -> None:
    """The default ``init_weights``: ``reset_parameters()`` on every submodule with one."""
    for m in module.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()


def distribute_module_state(module: nn.Module, plan: Plan, mesh, device: torch.device, *,
                            init_weights: Callable[[nn.Module], None] | None = None) -> None:
    """Replace every parameter and buffer named in the plan by a DTensor on ``mesh``, in
    place: an intra-op plan is the one-stage case of ``distribute_stages``.

    Real tensors are taken from rank 0; meta tensors become this rank's blocks, zeroed and
    then initialized by ``init_weights`` (default: ``reset_parameters``). ``init_weights``
    given for a real model re-initializes it on the DTensors.
    """
    distribute_stages(module, [(plan, mesh)], device, init_weights=init_weights)


def distribute_stages(module: nn.Module, stages: Sequence[tuple[Plan, DeviceMesh]],
                      device: torch.device, *,
                      init_weights: Callable[[nn.Module], None] | None = None) -> None:
    """Every parameter and buffer a stage's plan names becomes a DTensor on that stage's
    mesh, in place (``stages``: (intra-op plan, DeviceMesh) per stage). Ranks outside a
    stage's mesh hold no data for its tensors. Tied parameters stay tied: every module
    attribute holding one gets the same DTensor. Meta tensors are materialized on the
    single mesh of a one-stage plan only (see ``distribute_module_state``)."""
    new_by_id: dict[int, torch.Tensor] = {}
    materialized: list[str] = []
    named = {**dict(module.named_buffers()), **dict(module.named_parameters())}
    for plan, mesh in stages:
        for value in plan.parameters:
            old = named.get(value.name)
            if old is None:
                raise ValueError(f"the plan names {value.name!r}, which the model does not "
                                 "have; was the plan made for another model?")
            place = to_dtensor_placements(value.placements)
            if old.device.type == "meta":
                if len(stages) > 1:
                    raise ValueError(f"{value.name} is on the meta device; pipelines need real "
                                     "weights for now (build the model on CPU)")
                dt = local_zeros(old, mesh, place, device)
                materialized.append(value.name)
            else:
                dt = distribute_tensor(old.detach().to(device), mesh, place, src_data_rank=0)
            new_by_id[id(old)] = nn.Parameter(dt, requires_grad=old.requires_grad) \
                if isinstance(old, nn.Parameter) else dt
    _swap(module, new_by_id)
    _warn_stacked_strided(stages)
    left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers())
            if t.device.type == "meta"]
    if left:
        raise ValueError(f"{', '.join(left[:5])} stay on the meta device: the plan does not name "
                         "them (was it made for another model?)")
    if materialized or init_weights is not None:
        if len(stages) != 1:
            raise ValueError("init_weights= initializes the DTensors of one mesh; a pipeline's "
                             "stages take the model's real weights")
        if init_weights is None:
            _warn_uninitialized(module, set(materialized))
        initialize(module, stages[0][1], init_weights or reset_parameters)


def _swap(module: nn.Module, new_by_id: dict[int, torch.Tensor]) -> None:
    """Every module attribute holding a tensor of ``new_by_id`` holds its replacement."""
    for mod in module.modules():
        for key, p in list(mod._parameters.items()):
            if p is not None and id(p) in new_by_id:
                new = new_by_id[id(p)]
                assert isinstance(new, nn.Parameter), f"{key}: a parameter is swapped for one"
                mod._parameters[key] = new
        for key, b in list(mod._buffers.items()):
            if b is not None and id(b) in new_by_id:
                mod._buffers[key] = new_by_id[id(b)]


def stacked_strided_names(plan: Plan, mesh_shape: Sequence[int]) -> list[str]:
    """The plan's parameters and buffers held as a stacked strided shard (a fused q/k/v
    split by heads over two mesh axes: ``(S(0)/3, S(0)/3)``)."""
    shape = tuple(mesh_shape)
    return [v.name for v in plan.parameters
            if any(P.stacked_strided(tuple(v.placements), axis, shape)
                   for axis in range(len(v.placements)))]


def _warn_stacked_strided(stages: Sequence[tuple[Plan, DeviceMesh]]) -> None:
    """Say, once on the first rank, which tensors a user must not gather with DTensor's
    own ``full_tensor()``: PyTorch 2.13 lays a stacked strided shard out right but gathers
    it with the pieces mixed, silently (``runtime/lowering/strided_dtensor.py``)."""
    names = [n for plan, mesh in stages for n in stacked_strided_names(plan, mesh.shape)]
    if not names or (torch.distributed.is_initialized() and torch.distributed.get_rank() != 0):
        return
    warnings.warn(f"{', '.join(names[:4])}{' ...' if len(names) > 4 else ''} are split by heads "
                  "over two mesh axes (a stacked strided shard), which PyTorch's own gathers "
                  "(DTensor.full_tensor(), get_model_state_dict(full_state_dict=True)) mix "
                  "without an error and dcp.save refuses: read them whole with "
                  "torchalpa.full_tensor(p), save them with torchalpa.save_checkpoint / "
                  "save_pretrained", StridedGatherWarning,
                  stacklevel=4)


def _warn_uninitialized(module: nn.Module, materialized: set[str]) -> None:
    """Meta tensors that no ``reset_parameters()`` covers would silently stay zero."""
    covered = set()
    for prefix, m in module.named_modules():
        if callable(getattr(m, "reset_parameters", None)):
            for key in list(m._parameters) + list(m._buffers):
                covered.add(f"{prefix}.{key}" if prefix else key)
    left = sorted(materialized - covered)
    if left:
        warnings.warn(f"{', '.join(left[:8])}{' ...' if len(left) > 8 else ''} were built on the "
                      "meta device and no module's reset_parameters() sets them: they start as "
                      "zeros; pass auto_parallel(..., init_weights=fn) that initializes them",
                      MaterializeWarning, stacklevel=4)


def local_zeros(meta: torch.Tensor, mesh, placements, device) -> DTensor:
    """A DTensor of ``meta``'s global shape holding only this rank's block, zeroed."""
    shape = list(meta.shape)
    for axis, p in enumerate(placements):
        if P.is_shard(p):
            if shape[p.dim] % mesh.size(axis):
                raise ValueError(f"cannot shard dim {p.dim} of a {tuple(meta.shape)} tensor evenly "
                                 f"over {mesh.size(axis)} devices")
            shape[p.dim] //= mesh.size(axis)
    local = torch.zeros(shape, dtype=meta.dtype, device=device)
    contiguous = torch.empty(meta.shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=meta.shape, stride=contiguous)


def initialize(module: nn.Module, mesh, init_weights: Callable[[nn.Module], None]) -> None:
    """Run ``init_weights`` on the DTensor state; blocks of sharded tensors draw distinct
    random numbers (see the module docstring); replicas are synchronized afterwards."""
    if not callable(init_weights):
        raise TypeError(f"init_weights must be a callable taking the module, "
                        f"got {type(init_weights).__name__}")
    seed = _shared_seed()
    with torch.no_grad():
        if mesh.device_type == "cpu":
            with _ShardedRandom(seed), warnings.catch_warnings():
                # DTensor warns that it has no CPU random tracker: _ShardedRandom is ours
                warnings.filterwarnings("ignore", message="DTensor random operators")
                init_weights(module)
        else:
            init_weights(module)
        # named_* skip the second name of a tied tensor: each is synchronized once
        for _, t in list(module.named_parameters()) + list(module.named_buffers()):
            if isinstance(t, DTensor):
                _sync_replicas(t)


def _shared_seed() -> int:
    """A seed every rank agrees on (rank 0's next random number)."""
    import torch.distributed as dist

    from torchalpa.runtime.execution.mesh import world_size
    seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64)
    if world_size() > 1:
        dist.broadcast(seed, src=0)
    return int(seed.item())


def _sync_replicas(t: DTensor) -> None:
    """Make every replica of ``t``'s blocks equal to the one on coordinate 0 of each
    replicated mesh axis."""
    import torch.distributed as dist
    mesh = t.device_mesh
    local = t.to_local()
    for axis, p in enumerate(t.placements):
        if isinstance(p, Replicate) and mesh.size(axis) > 1:
            group = mesh.get_group(axis)
            dist.broadcast(local, group=group, group_src=0)


_RANDOM_FILLS = {"uniform_", "normal_", "bernoulli_", "random_", "exponential_",
                 "geometric_", "log_normal_", "cauchy_"}


class _ShardedRandom(TorchDispatchMode):
    """Random in-place fills of sharded DTensors draw from a per-(call, block) generator.

    A dispatch mode sees the ATen fill with the DTensor still whole (before DTensor turns
    it into the local op), whichever ``nn.init`` function issued it.
    """

    def __init__(self, seed: int):
        super().__init__()
        self.seed = seed
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        if func.overloadpacket.__name__ not in _RANDOM_FILLS or not isinstance(target, DTensor):
            return func(*args, **kwargs)
        self.calls += 1
        if not any(P.is_shard(p) for p in target.placements):
            return func(*args, **kwargs)   # replicated: the default stream (synced afterwards)
        block = _block_index(target)
        digest = hashlib.sha256(f"{self.seed}/{self.calls}/{block}".encode()).digest()
        kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int.from_bytes(digest[:8], "little") % (2 ** 63))
            return func(*args, **kwargs)


def _block_index(t: DTensor) -> tuple[int, ...]:
    """Which block of the global tensor this rank holds: its coordinate on sharded axes."""
    coords = t.device_mesh.get_coordinate()
    assert coords is not None, "this rank is not on the parameter's mesh"
    return tuple(c if P.is_shard(p) else 0 for c, p in zip(coords, t.placements))
