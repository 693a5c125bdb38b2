"""Random ops at run time: a sharded draw is one draw per block, replicas draw alike.

``passes/rules/random.py`` lets the planner shard random results (dropout masks, ``rand``,
``bernoulli``...). Lowering (``runtime.lowering.localize``) rewrites every random call whose result
is sharded on some mesh axis into a call of this module, with the rank's *block index*
baked in: its coordinate on each mesh axis that shards the result, 0 on the others. At
run time such a call

1. draws one 64-bit number from the default CPU generator -- every rank runs the same
   program from the same generator state, so every rank draws the same number, and each
   call (each op, each micro-batch, each step) draws a new one;
2. seeds a ``torch.Generator`` on the op's device with a hash of (that number, the block
   index), and draws the block with it.

So devices holding the same block (replicas along axes that do not shard the result) get
identical numbers, and different blocks get independent ones. A random op whose result
is replicated on every axis is not rewritten: it draws the whole tensor from the default
generator, as one device would.

RNG state. Everything random in a step derives from the default generator of each rank --
the CPU one (``torch.get_rng_state()``), and on GPUs the device's
(``torch.cuda.get_rng_state()``), which whole-tensor draws on the device use. Ranks must
agree on both: ``auto_parallel`` broadcasts rank 0's at wrap time (``sync_random_state``),
and ``check_replicas`` verifies it at each step. Saving both states with a checkpoint and
restoring them (on every rank) after ``auto_parallel`` makes a resumed run draw exactly
the masks the uninterrupted run draws.
"""

from __future__ import annotations

import functools
import hashlib
import warnings

import torch

from torchalpa.core.placement import is_shard

__all__ = ["RANDOM_OPS", "is_sharded", "block_index", "lower_random", "dropout", "draw",
           "block_seed", "sync_random_state", "RandomStateWarning"]

aten = torch.ops.aten

# op name -> position of its size argument (None: the op takes no size).
_SIZE_ARG = {
    "aten.rand.default": 0, "aten.randn.default": 0, "aten.randint.default": 1,
    "aten.randint.low": 2,
}
_OPS = {str(op): op for op in (
    aten.rand.default, aten.randn.default, aten.randint.default, aten.randint.low,
    aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
    aten.randint_like.low_dtype, aten.bernoulli.default, aten.bernoulli.p,
    aten.bernoulli_.float, aten.bernoulli_.Tensor, aten.uniform_.default,
    aten.normal_.default, aten.exponential_.default, aten.uniform.default,
    aten.exponential.default, aten.normal_functional.default)}
RANDOM_OPS = frozenset(_OPS) | {"aten.native_dropout.default"}
"""Random ops this module draws per block (``randperm`` is always drawn whole)."""


class RandomStateWarning(UserWarning):
    """The ranks' random generators differed when ``auto_parallel`` synchronized them."""


def is_sharded(placements) -> bool:
    return any(is_shard(p) for p in placements)


def block_index(placements, coords) -> tuple[int, ...]:
    """Which block of a result with ``placements`` this rank holds: its coordinate on
    each axis that shards it, 0 on the others (replicas share the index)."""
    return tuple(int(c) if is_shard(p) else 0 for p, c in zip(placements, coords))


def lower_random(node, args: list, kwargs: dict, out_shape: list[int], placements, coords):
    """(target, args, kwargs) of the per-block draw replacing random fx ``node``, whose
    first result has local shape ``out_shape``, for the rank at ``coords``."""
    name = str(node.target)
    block = block_index(placements, coords)
    if name == "aten.native_dropout.default":
        return _eager(dropout), [args[0], args[1], block], {}
    args = list(args)
    if name in _SIZE_ARG:
        args[_SIZE_ARG[name]] = list(out_shape)
    return _eager(draw), [name, block, *args], dict(kwargs)


@functools.cache
def _eager(fn):
    """``fn`` run eagerly under ``torch.compile`` (a graph break): traced, its draw from
    the default generator would become the compiler's own random op, which draws other
    numbers than eager runs (and checkpoints) expect."""
    return torch.compiler.disable(fn)


def block_seed(block: tuple[int, ...]) -> int:
    """Draw this call's number from the default generator; the seed of ``block``."""
    number = int(torch.randint(-2 ** 63, 2 ** 63 - 1, (), dtype=torch.int64))
    digest = hashlib.blake2b(f"{number}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2 ** 63 - 1)


def _generator(device, block) -> torch.Generator:
    gen = torch.Generator(device=torch.device(device) if device is not None else "cpu")
    gen.manual_seed(block_seed(block))
    return gen


def draw(op: str, block: tuple[int, ...], *args, **kwargs):
    """Random op ``op`` on this rank's block, from the block's own generator."""
    target = _OPS[op]
    device = kwargs.get("device") if op in _SIZE_ARG else args[0].device
    return target.overloadpacket(*args, generator=_generator(device, block), **kwargs)


def dropout(x: torch.Tensor, p: float, block: tuple[int, ...]):
    """``native_dropout(x, p, train=True)`` with this block's own mask: (output, mask)."""
    if p >= 1:
        return torch.zeros_like(x), torch.zeros_like(x, dtype=torch.bool)
    keep = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    keep.bernoulli_(1 - p, generator=_generator(x.device, block))
    return x * keep * (1.0 / (1 - p)), keep.bool()


# -- the ranks' generators ---------------------------------------------------------------

def _states(device: torch.device) -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def sync_random_state(device: torch.device) -> bool:
    """Give every rank rank 0's default generator state(s); True if some rank's differed
    (then a ``RandomStateWarning`` says so). Call on every rank."""
    import torch.distributed as dist

    from torchalpa.runtime.execution.mesh import comm_device, world_size
    if world_size() == 1:
        return False
    differed = False
    comm = comm_device()
    for i, state in enumerate(_states(device)):
        mine = state.to(comm)
        theirs = mine.clone()
        dist.broadcast(theirs, src=0)
        same = torch.tensor([int(torch.equal(mine, theirs))], device=comm)
        dist.all_reduce(same, op=dist.ReduceOp.MIN)
        differed |= not bool(same.item())
        if i == 0:
            torch.set_rng_state(theirs.cpu())
        else:
            torch.cuda.set_rng_state(theirs.cpu(), device)
    if differed:
        warnings.warn(
            "the ranks' random generators differed when auto_parallel started (e.g. "
            "torch.manual_seed(seed + rank)); every rank now continues from rank 0's state, "
            "so that replicated values draw the same random numbers on every rank and sharded "
            "ones draw independent numbers per block. Seed every rank alike to silence this; "
            "give per-rank randomness (data augmentation) its own torch.Generator",
            RandomStateWarning, stacklevel=3)
    return differed
