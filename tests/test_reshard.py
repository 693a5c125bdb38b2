"""The redistribution planner's steps, run by the runtime's collective helpers, turn every
layout into every reachable one -- checked on all ranks at once with LocalTensorMode."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from simulate import block, combine, coords_of

from torchalpa.core.cluster import LogicalMesh
from torchalpa.core.opgraph import TensorSpec
from torchalpa.core.placement import (
    Partial,
    Replicate,
    Shard,
    long_form,
    parse_placement,
    short_form,
    split_factor_of,
    strided,
)
from torchalpa.passes.pricing.cost import collective_cost, steps_cost
from torchalpa.passes.sharding.reshard import plan_reshard
from torchalpa.runtime.execution import collectives as C

PER_AXIS = [Replicate(), Shard(0), Shard(1), Partial("sum")]
# a Partial max or min (amax/amin over a split dim) is made whole or split the same way
PARTIAL_EXTREMES = [(Partial("max"), Replicate()), (Partial("max"), Shard(1)),
                    (Partial("min"), Replicate()), (Replicate(), Partial("max"))]


@pytest.fixture(scope="module")
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()


def _run_steps(x, steps, mesh_shape, groups, coords, rank_coords=None):
    for s in steps:
        if s.kind == "partition":   # coordinates are per-rank here: apply it rank by rank
            from torch.distributed._local_tensor import LocalTensor
            x = LocalTensor({r: C.local_partition(t, rank_coords[r][s.axis], s.reduce_op)
                             for r, t in x._local_tensors.items()})
        else:
            fn, args = C.step_call(s, mesh_shape, coords, groups)
            x = fn(x, *args)
    return x


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)])
def test_every_transition(fake_world, mesh_shape):
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    full = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8) / 7
    spec = TensorSpec((8, 8))
    layouts = list(itertools.product(PER_AXIS, repeat=len(mesh_shape)))
    rank_coords = coords_of(mesh_shape)  # rank r sits at rank_coords[r] (row-major)
    checked = impossible = 0
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", mesh_shape)
        groups = [mesh.get_group(i).group_name for i in range(len(mesh_shape))]
        coords = mesh.get_coordinate()
        for src, dst in itertools.product(layouts, layouts):
            steps = plan_reshard(spec, src, dst, mesh_shape)
            if steps is None:
                assert any(isinstance(d, Partial) and s != d and isinstance(s, Shard)
                           for s, d in zip(src, dst))
                impossible += 1
                continue
            x = LocalTensor({r: block(full, src, mesh_shape, c) for r, c in enumerate(rank_coords)})
            y = _run_steps(x, steps, mesh_shape, groups, coords, rank_coords)
            blocks = {c: y._local_tensors[r] for r, c in enumerate(rank_coords)}
            if any(isinstance(d, Partial) for d in dst):
                assert torch.allclose(combine(blocks, dst, mesh_shape), full, atol=1e-5)
            else:
                for c, b in blocks.items():
                    assert torch.allclose(b, block(full, dst, mesh_shape, c), atol=1e-5), \
                        (src, dst, [s.kind for s in steps])
            # each step records what a rank contributes: its local bytes before the step
            for s in steps:
                assert s.bytes == full[tuple(slice(0, n) for n in _local(s.src, mesh_shape))].numel() * 4
            checked += 1
    assert checked + impossible == len(layouts) ** 2 and checked > impossible > 0


@pytest.mark.parametrize("src,dst", PARTIAL_EXTREMES)
def test_partial_max_and_min_transitions(fake_world, src, dst):
    """An all-reduce (or reduce-scatter) with the Partial's own op on 4 ranks gives the
    whole max (min); a replicated value taken as a Partial max stays itself on every rank."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    full = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    rank_coords = coords_of((4,))
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", (4,))
        groups = [mesh.get_group(0).group_name]
        steps = plan_reshard(TensorSpec((8, 8)), (src,), (dst,), (4,))
        assert steps is not None and all(s.reduce_op == src.reduce_op for s in steps
                                         if s.kind != "partition")
        x = LocalTensor({r: block(full, (src,), (4,), c) for r, c in enumerate(rank_coords)})
        y = _run_steps(x, steps, (4,), groups, mesh.get_coordinate(), rank_coords)
        blocks = {c: y._local_tensors[r] for r, c in enumerate(rank_coords)}
    assert not torch.equal(block(full, (src,), (4,), (0,)), full) or src == Replicate()
    if isinstance(dst, Partial):
        assert torch.equal(combine(blocks, (dst,), (4,)), full)
    else:
        for c, b in blocks.items():
            assert torch.equal(b, block(full, (dst,), (4,), c)), (src, dst)


def _local(placements, mesh_shape):
    shape = [8, 8]
    for a, p in enumerate(placements):
        if isinstance(p, Shard):
            shape[p.dim] //= mesh_shape[a]
    return shape


def test_our_blocks_are_dtensor_blocks(fake_world):
    """A parameter distributed by DTensor holds exactly the block the local program assumes."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from torchalpa.runtime.execution.module import to_dtensor_placements
    full = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8)
    rank_coords = coords_of((2, 2))
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", (2, 2))
        for layout in itertools.product([Replicate(), Shard(0), Shard(1)], repeat=2):
            same_everywhere = LocalTensor({r: full.clone() for r in range(4)})
            dt = distribute_tensor(same_everywhere, mesh, to_dtensor_placements(layout))
            local = dt.to_local()
            for r, c in enumerate(rank_coords):
                assert torch.equal(local._local_tensors[r], block(full, layout, (2, 2), c)), layout


def test_plans_use_direct_collectives():
    spec = TensorSpec((8, 8))
    m = (4,)
    kinds = lambda a, b: [s.kind for s in plan_reshard(spec, (a,), (b,), m)]
    assert kinds(Partial(), Replicate()) == ["all_reduce"]
    assert kinds(Partial(), Shard(0)) == ["reduce_scatter"]
    assert kinds(Shard(0), Replicate()) == ["all_gather"]
    assert kinds(Shard(0), Shard(1)) == ["all_to_all"]
    assert kinds(Replicate(), Shard(1)) == ["slice"]
    assert kinds(Replicate(), Partial()) == ["partition"]
    assert plan_reshard(spec, (Shard(0),), (Partial(),), m) is None
    # a dim split over both axes is reassembled inner axis first
    steps = plan_reshard(spec, (Shard(0), Shard(0)), (Replicate(), Replicate()), (2, 2))
    assert [(s.kind, s.axis) for s in steps] == [("all_gather", 1), ("all_gather", 0)]
    # a partial sum scatters inside an outer split (DTensor's nesting order), and partial
    # sums on both axes scatter outer axis first, the inner one inside its pieces
    axes = lambda a, b: [(s.kind, s.axis) for s in plan_reshard(spec, a, b, (2, 2))]
    assert axes((Shard(0), Partial()), (Shard(0), Shard(0))) == [("reduce_scatter", 1)]
    assert axes((Partial(), Partial()), (Shard(0), Shard(0))) == [("reduce_scatter", 0),
                                                                  ("reduce_scatter", 1)]
    assert axes((Partial(), Partial()), (Shard(1), Shard(0))) == [("reduce_scatter", 0),
                                                                  ("reduce_scatter", 1)]


def test_outer_gather_then_all_to_all():
    """``(S(0), S(1)) -> (R, S(0))`` on (2, 2), the read of a conv weight Alpa's
    prefer_reduce_scatter stores split on both axes (Alpa's conv net with mixed mesh
    shapes): gathered on axis 0, then moved by an all-to-all on axis 1, where gathering on
    axis 1, then axis 0, and slicing moved twice the bytes on axis 0 for the same on axis 1.
    test_every_transition checks the blocks it leaves."""
    spec = TensorSpec((8, 8, 3, 3))                     # 2,304 bytes
    src, dst = (Shard(0), Shard(1)), (Replicate(), Shard(0))
    steps = plan_reshard(spec, src, dst, (2, 2))
    assert [(s.kind, s.axis, s.bytes) for s in steps] == [("all_gather", 0, 576),
                                                          ("all_to_all", 1, 1152)]
    assert steps[0].dst == (Replicate(), Shard(1)) and steps[1].src_dim == 1
    gathers = plan_reshard(spec, src, dst, (2, 2), True, False)    # all-to-all not allowed
    assert [(s.kind, s.axis, s.bytes) for s in gathers] == [
        ("all_gather", 1, 576), ("all_gather", 0, 1152), ("slice", 1, 2304)]
    # priced as it runs: Alpa's conv mesh (alpha 1, beta (1, 0.1))
    mesh = LogicalMesh(shape=(2, 2), beta=(1.0, 0.1))
    assert steps_cost(mesh, steps) == pytest.approx(2 + 576 + 0.1 * 1152 / 2)
    assert steps_cost(mesh, gathers) == pytest.approx(2 + 0.1 * 576 + 1152)
    # with 4 devices on the outer axis the all-to-all costs more on axis 1 than the inner
    # gather (twice its bandwidth term): not cheaper for every bandwidth, the gathers stay
    assert [s.kind for s in plan_reshard(spec, src, dst, (4, 2))] == [
        "all_gather", "all_gather", "slice"]


def test_alpha_beta_costs():
    mesh = LogicalMesh(shape=(4, 2), alpha=(1.0, 2.0), beta=(1.0, 0.1))
    B = 1000
    assert collective_cost(mesh, "all_reduce", 0, B) == 1 + 2 * 3 / 4 * B
    assert collective_cost(mesh, "all_gather", 1, B / 2) == pytest.approx(2 + 0.1 * 1 / 2 * B)
    assert collective_cost(mesh, "reduce_scatter", 0, B) == 1 + 3 / 4 * B
    assert collective_cost(mesh, "all_to_all", 0, B / 4) == pytest.approx(1 + 3 / 16 * B * 2)
    gloo = LogicalMesh(shape=(4,), backend="gloo")
    assert collective_cost(gloo, "reduce_scatter", 0, B) == collective_cost(gloo, "all_reduce", 0, B)
    steps = plan_reshard(TensorSpec((8, 8)), (Partial(),), (Replicate(),), (4,))
    assert steps_cost(LogicalMesh(shape=(4,)), steps) == 1 + 1.5 * 256


STRIDED_1D = [(Replicate(),), (Shard(0),), (Shard(1),), (strided(0, 2),), (strided(1, 2),),
              (Partial("sum"),)]
STRIDED_2D = [(Replicate(), strided(0, 2)), (Shard(1), strided(0, 2)),
              (strided(0, 2), Shard(1)), (Shard(0), Replicate()), (Replicate(), Replicate()),
              (Partial("sum"), strided(0, 2)), (Replicate(), Shard(0))]


@pytest.mark.parametrize("mesh_shape,layouts", [((4,), STRIDED_1D), ((2, 2), STRIDED_2D)])
def test_strided_shard_transitions_give_dtensor_blocks(fake_world, mesh_shape, layouts):
    """A strided shard (a block of each of k pieces of a dim: a fused q/k/v split by heads)
    is gathered, reduce-scattered into, sliced to and left for another split by the
    planner's steps and the runtime's collectives; every rank ends with the block DTensor's
    own ``_StridedShard`` gives it (``distribute_tensor`` is the oracle here)."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    full = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8) / 7
    rank_coords = coords_of(mesh_shape)
    checked = 0
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", mesh_shape)
        groups = [mesh.get_group(i).group_name for i in range(len(mesh_shape))]

        def dtensor_blocks(layout):
            same = LocalTensor({r: full.clone() for r in range(4)})
            local = distribute_tensor(same, mesh, list(layout)).to_local()
            return {r: local._local_tensors[r] for r in range(4)}

        for src, dst in itertools.product(layouts, layouts):
            if any(isinstance(d, Partial) for d in dst):
                continue
            steps = plan_reshard(TensorSpec((8, 8)), src, dst, mesh_shape)
            assert steps is not None, (src, dst)
            if src == (Partial("sum"),):
                start = {r: block(full, src, mesh_shape, c) for r, c in enumerate(rank_coords)}
            elif any(isinstance(s, Partial) for s in src):
                # the Partial axis's pieces, then the other axis's strided block of each
                pieces = {c: block(full, src[:1] + (Replicate(),), mesh_shape, c)
                          for c in rank_coords}
                start = {r: C.local_chunk(pieces[c], src[1].dim, 2, c[1],
                                          split_factor_of(src[1]))
                         for r, c in enumerate(rank_coords)}
            else:
                start = dtensor_blocks(src)
            y = _run_steps(LocalTensor(start), steps, mesh_shape, groups, mesh.get_coordinate(),
                           rank_coords)
            want = dtensor_blocks(dst)
            for r in range(4):
                assert torch.allclose(y._local_tensors[r], want[r], atol=1e-5), \
                    (src, dst, [s.kind for s in steps])
            if any(split_factor_of(p) > 1 for p in src + dst) and src != dst:
                assert not any(s.kind == "all_to_all" and split_factor_of(s.src[s.axis]) +
                               split_factor_of(s.dst[s.axis]) > 2 for s in steps)
                checked += 1
    assert checked >= 10


def test_strided_placements_read_and_write_as_text():
    p = strided(0, 3)
    assert (long_form(p), short_form(p)) == ("StridedShard(0, 3)", "S(0)/3")
    assert parse_placement("StridedShard(0, 3)") == p == parse_placement("S(0)/3")
    assert parse_placement("S(0)/3") != Shard(0)


NESTED = (strided(0, 2), Shard(0))
"""DTensor's ``(_StridedShard(0, split_factor=2), Shard(0))`` on (2, 2): dim 0 split on
axis 1 first and on axis 0 within each of its two pieces (FSDP over tensor parallelism;
Alpa's ``prefer_reduce_scatter`` stores a column-parallel bias so)."""


def test_nested_strided_shard_round_trips(fake_world):
    """The nested strided shard is reached from the layouts around it by the steps Alpa's
    rewrite issues (a partial sum on axis 0 reduce-scattered into it, forward's read
    gathered on axis 0 alone) and by slices; gathering it back gives the original tensor
    on every rank, and every intermediate block is DTensor's own (``distribute_tensor`` is
    the oracle)."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    mesh_shape = (2, 2)
    full = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8) / 7
    spec = TensorSpec((8, 8))
    rank_coords = coords_of(mesh_shape)
    kinds = lambda a, b: [(s.kind, s.axis) for s in plan_reshard(spec, a, b, mesh_shape)]
    column = (Replicate(), Shard(0))
    assert kinds((Partial("sum"), Shard(0)), NESTED) == [("reduce_scatter", 0)]
    assert kinds(NESTED, column) == [("all_gather", 0)]
    assert kinds(column, NESTED) == [("slice", 0)]
    assert kinds(NESTED, (Replicate(), Replicate())) == [("all_gather", 1), ("all_gather", 0)]
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", mesh_shape)
        groups = [mesh.get_group(i).group_name for i in range(2)]

        def dtensor_blocks(layout):
            same = LocalTensor({r: full.clone() for r in range(4)})
            local = distribute_tensor(same, mesh, list(layout)).to_local()
            return {r: local._local_tensors[r] for r in range(4)}

        def run(start, src, dst):
            steps = plan_reshard(spec, src, dst, mesh_shape)
            assert steps is not None, (src, dst)
            y = _run_steps(LocalTensor(start), steps, mesh_shape, groups,
                           mesh.get_coordinate(), rank_coords)
            return {r: y._local_tensors[r] for r in range(4)}

        # a gradient: each axis-1 piece, a partial sum over axis 0 (rank (0, c) holds 1/3
        # of it, rank (1, c) the rest)
        piece = dtensor_blocks(column)
        partial = {r: piece[r] * (1 / 3 if c[0] == 0 else 2 / 3)
                   for r, c in enumerate(rank_coords)}
        nested = dtensor_blocks(NESTED)
        for start, src in ((partial, (Partial("sum"), Shard(0))), (piece, column),
                           (dtensor_blocks((Replicate(), Replicate())),
                            (Replicate(), Replicate())),
                           (dtensor_blocks((strided(0, 2), Replicate())),
                            (strided(0, 2), Replicate()))):
            got = run(start, src, NESTED)
            for r in range(4):
                assert torch.allclose(got[r], nested[r], atol=1e-6), (src, r)
        # and back: each layout it is read in, and the whole tensor on every rank
        for dst in (column, (strided(0, 2), Replicate()), (Replicate(), Replicate())):
            got, want = run(nested, NESTED, dst), dtensor_blocks(dst)
            for r in range(4):
                assert torch.equal(got[r], want[r]), (dst, r)
        whole = run(nested, NESTED, (Replicate(), Replicate()))
        assert all(torch.equal(whole[r], full) for r in range(4))


def test_nested_strided_is_told_from_a_lone_one():
    from torchalpa.passes.sharding.reshard import nested_strided
    assert nested_strided(NESTED, 0, (2, 2)) and not nested_strided(NESTED, 1, (2, 2))
    assert not nested_strided((strided(0, 2), Replicate()), 0, (2, 2))
    assert not nested_strided((strided(0, 3), Shard(0)), 0, (2, 2))
    assert not nested_strided((Shard(0), strided(0, 2)), 1, (2, 2))


def test_step_call_refuses_strided_layouts_it_cannot_lay_out():
    """A strided shard whose pieces the later axes' splits of its dim do not make (3
    pieces inside axis 1's 2) is no layout the runtime lays out: a clear error, not a
    wrong block."""
    from torchalpa.core.plan import ReshardStep
    step = ReshardStep(kind="slice", axis=0, bytes=256, src=(Replicate(), Shard(0)),
                       dst=(strided(0, 3), Shard(0)), dim=0)
    with pytest.raises(ValueError, match="cannot lay out"):
        C.step_call(step, (2, 2), (0, 0), ("g0", "g1"))
    nested = ReshardStep(kind="all_gather", axis=0, bytes=64, src=NESTED,
                         dst=(Replicate(), Shard(0)), dim=0)
    assert C.step_call(nested, (2, 2), (0, 0), ("g0", "g1"))[0] is C.all_gather


def test_nested_strided_dtensors_redistribute(fake_world):
    """``strided_dtensor.redistribute`` (checkpoints, ``full_value``) moves a DTensor held
    as a nested strided shard to and from the layouts around it, also where DTensor
    itself cannot (2.13: to a lone strided shard; 2.11: any strided shard), by the
    runtime's own gathers (``_by_hand``, run here for every pair): every rank holds
    DTensor's block."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from torchalpa.runtime.lowering.strided_dtensor import _by_hand, redistribute
    full = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8) / 7
    layouts = [NESTED, (Replicate(), Replicate()), (Replicate(), Shard(0)),
               (strided(0, 2), Replicate()), (Shard(0), Shard(0)), (Shard(1), Shard(0))]
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", (2, 2))

        def dtensor(layout):
            return distribute_tensor(LocalTensor({r: full.clone() for r in range(4)}), mesh,
                                     list(layout))

        for src, dst in itertools.product(layouts, layouts):
            if NESTED not in (src, dst):
                continue
            want = dtensor(dst).to_local()._local_tensors
            for move in (_by_hand, redistribute):
                got = move(dtensor(src), dst)
                assert tuple(got.placements) == tuple(dst)
                for r in range(4):
                    assert torch.equal(got.to_local()._local_tensors[r], want[r]), \
                        (move.__name__, src, dst, r)


def test_pretrained_block_of_a_nested_strided_shard(fake_world):
    """Loading pretrained weights reads a strided shard's dim whole, other axes' blocks as
    they are, then cuts this rank's part: for a nested strided shard the block read is
    axis 1's piece, of which axis 0's part is a plain block (it was cut as 2 pieces of
    the piece: a wrong block of the right shape, silently)."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from torchalpa.runtime.state.pretrained_load import _strided_part
    full = torch.arange(8 * 8, dtype=torch.float32).reshape(8, 8)
    rank_coords = coords_of((2, 2))
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", (2, 2))
        dt = distribute_tensor(LocalTensor({r: full.clone() for r in range(4)}), mesh,
                               list(NESTED))
        read = LocalTensor({r: full[4 * c[1]:4 * c[1] + 4] for r, c in enumerate(rank_coords)})
        got = _strided_part(dt, read)
        for r in range(4):
            assert torch.equal(got._local_tensors[r], dt.to_local()._local_tensors[r]), r


STACKED = (strided(0, 3), strided(0, 3))
"""DTensor's ``(_StridedShard(0, 3), _StridedShard(0, 3))`` on (2, 2), read left to right:
dim 0 as 3 pieces (a fused (3, H) q/k/v's rows), each split on axis 0 and each of those
halves on axis 1, so every rank holds its quarter of q's, k's and v's rows, the quarter
``(Shard(0), Shard(0))`` gives it of a separate q, k or v."""


def _stacked_block(full, coord):
    """Rank ``coord``'s block of ``STACKED`` from the whole tensor, by hand: of each third,
    quarter ``2 * i + j``."""
    rows = full.shape[0] // 12
    return full.view(3, 2, 2, rows, *full.shape[1:])[:, coord[0], coord[1]].flatten(0, 1)


def test_stacked_strided_shard_round_trips(fake_world):
    """The stacked strided shard (the other nesting than ``NESTED``: the pieces outermost,
    axis 0's split outside axis 1's) is reached by slices, by reduce-scatters of partial
    sums (outer axis first, each a strided scatter on the block), and gathered back inner
    axis first; every rank's block is the whole tensor split that way, at every step's
    end, and the whole tensor comes back on every rank."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    mesh_shape = (2, 2)
    full = torch.arange(24 * 4, dtype=torch.float32).reshape(24, 4) / 7
    spec = TensorSpec((24, 4))
    rank_coords = coords_of(mesh_shape)
    kinds = lambda a, b: [(s.kind, s.axis) for s in plan_reshard(spec, a, b, mesh_shape)]
    lone = (strided(0, 3), Replicate())
    assert kinds((Replicate(), Replicate()), STACKED) == [("slice", 0), ("slice", 1)]
    assert kinds(lone, STACKED) == [("slice", 1)]
    assert kinds((strided(0, 3), Partial("sum")), STACKED) == [("reduce_scatter", 1)]
    assert kinds((Partial("sum"), Partial("sum")), STACKED) == [("reduce_scatter", 0),
                                                                 ("reduce_scatter", 1)]
    assert kinds(STACKED, lone) == [("all_gather", 1)]
    assert kinds(STACKED, (Replicate(), Replicate())) == [("all_gather", 1), ("all_gather", 0)]
    others = [(Replicate(), Replicate()), lone, (Replicate(), strided(0, 3)),
              (Shard(0), Shard(0)), (Shard(1), strided(0, 3)), (strided(0, 3), Shard(1)),
              (Shard(0), Replicate())]
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", mesh_shape)
        groups = [mesh.get_group(i).group_name for i in range(2)]

        def run(src, dst):
            steps = plan_reshard(spec, src, dst, mesh_shape)
            assert steps is not None, (src, dst)
            start = LocalTensor({r: block(full, src, mesh_shape, c)
                                 for r, c in enumerate(rank_coords)})
            y = _run_steps(start, steps, mesh_shape, groups, mesh.get_coordinate(), rank_coords)
            return {c: y._local_tensors[r] for r, c in enumerate(rank_coords)}

        for src in others + [(strided(0, 3), Partial("sum")), (Partial("sum"), Partial("sum")),
                             (Partial("sum"), strided(0, 3))]:
            got = run(src, STACKED)
            for c in rank_coords:
                assert torch.allclose(got[c], _stacked_block(full, c), atol=1e-5), (src, c)
        for dst in others:
            got = run(STACKED, dst)
            for c in rank_coords:
                assert torch.equal(got[c], block(full, dst, mesh_shape, c)), (dst, c)
        whole = run(STACKED, (Replicate(), Replicate()))
        assert all(torch.equal(w, full) for w in whole.values())


def test_stacked_strided_dtensors_redistribute_and_load(fake_world):
    """DTensor lays ``STACKED`` out as ``_stacked_block`` does, but 2.13 gathers it wrong,
    silently (its pieces mixed); ``strided_dtensor.redistribute`` (checkpoints,
    ``full_value``) moves it by the runtime's gathers, inner axis first, to and from the
    layouts around it; loading pretrained weights cuts each rank's block from the rows
    read whole (it raised: a strided shard stacked on another)."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from torchalpa.runtime.lowering.strided_dtensor import full_value, redistribute
    from torchalpa.runtime.state.pretrained_load import _strided_part
    full = torch.arange(24 * 4, dtype=torch.float32).reshape(24, 4)
    rank_coords = coords_of((2, 2))
    layouts = [(Replicate(), Replicate()), (Shard(0), Shard(0)), (strided(0, 3), Replicate()),
               (Replicate(), Shard(1)), (Shard(1), strided(0, 3))]
    with LocalTensorMode(4):
        mesh = init_device_mesh("cpu", (2, 2))

        def dtensor(layout):
            return distribute_tensor(LocalTensor({r: full.clone() for r in range(4)}), mesh,
                                     list(layout))

        stacked = dtensor(STACKED)
        for r, c in enumerate(rank_coords):
            assert torch.equal(stacked.to_local()._local_tensors[r], _stacked_block(full, c))
        assert all(torch.equal(t, full) for t in full_value(stacked)._local_tensors.values())
        for other in layouts:
            got = redistribute(stacked, other)
            back = redistribute(dtensor(other), STACKED)
            assert tuple(got.placements) == other and tuple(back.placements) == STACKED
            for r, c in enumerate(rank_coords):
                assert torch.equal(got.to_local()._local_tensors[r],
                                   block(full, other, (2, 2), c)), (other, c)
                assert torch.equal(back.to_local()._local_tensors[r],
                                   _stacked_block(full, c)), (other, c)
        read = LocalTensor({r: full.clone() for r in range(4)})
        got = _strided_part(stacked, read)
        for r, c in enumerate(rank_coords):
            assert torch.equal(got._local_tensors[r], _stacked_block(full, c)), c


def test_step_call_refuses_a_stacked_strided_steps_out_of_order():
    """Gathering the outer axis of a stacked strided shard while the inner one still splits
    the dim would mix the pieces: refused in one line, not a wrong block."""
    from torchalpa.core.plan import ReshardStep
    step = ReshardStep(kind="all_gather", axis=0, bytes=64, src=STACKED,
                       dst=(Replicate(), strided(0, 3)), dim=0)
    with pytest.raises(ValueError, match="while a later axis splits that dim"):
        C.step_call(step, (2, 2), (0, 0), ("g0", "g1"))
    inner = ReshardStep(kind="all_gather", axis=1, bytes=64, src=STACKED,
                        dst=(strided(0, 3), Replicate()), dim=0)
    assert C.step_call(inner, (2, 2), (0, 0), ("g0", "g1")) == (
        C.all_gather_strided, (0, 2, "g1", 3))
