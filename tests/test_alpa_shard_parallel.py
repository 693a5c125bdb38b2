"""Alpa's ``tests/shard_parallel`` assertions, ported to the public planning API.

Each case plans the model Alpa's test builds (written here in PyTorch, several ways a
user would write it) on Alpa's logical mesh and cost units, and checks Alpa's objective
(1% tolerance), its collective counts and its parameter layouts. Where our accounting
differs from Alpa's by construction the test says so and asserts our exact figure:

* the loss: our plan gathers the scalar loss on every device (an all-reduce of 4 bytes
  when the batch is split), which Alpa's objective leaves out;
* Alpa adds a tie-breaking penalty per replicated parameter and optimizer state
  (``replicated_penalty``), and 0.01 / 0.1 per collective; we add neither;
* XLA merges gradient all-reduces after the ILP: our plans list the merged buckets when
  ``all_reduce_threshold`` is set, and the counts below read them.

Planning only (no processes); Alpa's counts assume its default search space, so the
cases set ``allow_reduce_scatter`` as Alpa's ``prefer_reduce_scatter`` would (the 2D
cases set ``prefer_reduce_scatter`` itself: Alpa's rewrite after the ILP).
"""

import functools

import pytest
import torch
from alpa_cases import (
    MLP_SPELLINGS,
    BertLayers,
    BertMLM,
    ConvNet,
    DenseDropoutDense,
    DenseGatherDense,
    DepthwiseConvNet,
    DotAllToAll,
    Gemv,
    MoELayer,
    TiedEmbedding,
    all_reduce_cost,
    all_to_all_cost,
    assert_close,
    bert_inputs,
    bert_matmul_weights,
    communication,
    conv_inputs,
    mlm_inputs,
    mlm_loss,
    mlp_weight_names,
    mse,
    plan_of,
    summed_cross_entropy,
    summed_nll_of_log_softmax,
    weights,
)

from torchalpa import DataParallel, Replicate, Shard, Zero2Parallel, Zero3Parallel
from torchalpa.core.placement import strided

MERGE_ALL = 1 << 60     # Alpa's default all_reduce_threshold: one bucket
# every spelling of Alpa's MLP; the third runs with the slow tests
SPELLINGS = [pytest.param(name, marks=[pytest.mark.slow] if name == "attributes" else [])
             for name in sorted(MLP_SPELLINGS)]


def _mlp(spelling, num_layers, batch, hidden):
    cls = MLP_SPELLINGS[spelling]
    model = cls(num_layers, hidden, hidden, hidden)
    x, y = torch.empty(batch, hidden), torch.empty(batch, hidden)
    return model, (x, y)


def _data_parallel_objective(model, mesh, axis):
    """Alpa's ``assert_data_parallel_cost`` expectation, without its replicated-parameter
    tie-break penalty: one all-reduce per gradient over ``axis``."""
    return sum(all_reduce_cost(mesh, p.numel() * 4, axis) for p in model.parameters())


def _loss_all_reduce(mesh, axis):
    return all_reduce_cost(mesh, 4, axis)


# -- test_mlp.py ----------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_mlp_data_parallel(spelling, axis, shape):
    model, batch = _mlp(spelling, 6, 256, 32)
    plan, mesh = plan_of(model, batch, shape=shape, all_reduce_threshold=MERGE_ALL)
    expected = _data_parallel_objective(model, mesh, axis)
    assert_close(plan.estimates.objective, expected)
    # our exact figure: the same plus the scalar loss's all-reduce
    assert plan.estimates.objective == pytest.approx(expected + _loss_all_reduce(mesh, axis))
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == 1 and counts["total"] == 1, counts
    for placements in weights(plan).values():
        assert all(p == Replicate() for p in placements)


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_mlp_model_parallel(spelling, axis, shape):
    num_layers, batch_size, hidden = 6, 32, 256
    model, batch = _mlp(spelling, num_layers, batch_size, hidden)
    plan, mesh = plan_of(model, batch, shape=shape, all_reduce_threshold=MERGE_ALL)
    expected = (num_layers - 1) * all_reduce_cost(mesh, batch_size * hidden * 4, axis)
    assert_close(plan.estimates.objective, expected)
    counts = communication(plan)
    assert counts["all_reduce"] == num_layers - 1 and counts["total"] == num_layers - 1, counts
    # kernels alternate column- and row-partitioned (torch weights are (out, in))
    layouts = weights(plan)
    for k, name in enumerate(mlp_weight_names(model)):
        want = Shard(0) if k % 2 == 0 else Shard(1)
        assert layouts[name][axis] == want, (name, layouts[name])


ALPA_2D = dict(force_batch_dim_to_mesh_dim=0, allow_mixed_mesh_shape=False,
               slice_before_reduce=False)
"""Alpa's search space on a 2D mesh: the batch on mesh axis 0 alone (Alpa sets it when both
axes have devices), no dim split over both axes (``allow_mixed_mesh_shape``), and no sum
over a slice of a whole operand or slice of a partial sum before its all-reduce
(``slice_before_reduce``: Alpa's reductions follow their operand's layout and all-reduce
the whole tile they make, so a gradient summed over axis 0 is never cut in half over
axis 1 first)."""


def _mlp_2d_plan(spelling, **options):
    num_layers, batch_size, hidden = 6, 256, 32
    model, batch = _mlp(spelling, num_layers, batch_size, hidden)
    plan, mesh = plan_of(model, batch, shape=(2, 2), beta=(1, 0.1),
                         all_reduce_threshold=MERGE_ALL, **{**ALPA_2D, **options})
    expected = (num_layers * (all_reduce_cost(mesh, hidden * hidden * 4 / 2, 0)
                              + all_reduce_cost(mesh, hidden * 4, 0))
                + (num_layers - 1) * all_reduce_cost(mesh, batch_size * hidden * 4 / 2, 1))
    return model, plan, expected


def _assert_replicated_megatron(model, plan, names):
    """Alpa's assert_replicated_column/row_partitioned: replicated on axis 0, kernels
    alternately column- and row-partitioned on axis 1 (torch weights are (out, in))."""
    layouts = weights(plan)
    for k, name in enumerate(names):
        want = (Replicate(), Shard(0) if k % 2 == 0 else Shard(1))
        assert layouts[name] == want, (name, layouts[name])


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_mlp_2d_mesh(spelling):
    """Alpa's test_n_layer_mlp_2d_mesh, every assertion: the objective (21,078 vs Alpa's
    21,265: the column-parallel layers' biases are reduced at their half size, Alpa's
    formula prices them whole), 6 all-reduces (5 activations on axis 1, the gradients
    merged on axis 0) and nothing else, Megatron layouts on axis 1."""
    model, plan, expected = _mlp_2d_plan(spelling)
    assert_close(plan.estimates.objective, expected)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == counts["total"] == 6, counts
    assert len(plan.estimates.gradient_buckets) == 1
    _assert_replicated_megatron(model, plan, mlp_weight_names(model))


def test_mlp_2d_mesh_slicing_before_reduce():
    """Outside Alpa's space (``slice_before_reduce``, our default): the row-parallel
    layers' bias gradients are summed over axis 0 on half of each (a slice of the whole
    output gradient, or of the partial sum) and gathered on axis 1, 7.4 units where the
    whole all-reduce costs 64 more: 20,908, 3 all-gathers besides the 6 all-reduces."""
    _, alpa, _ = _mlp_2d_plan("modulelist")
    _, plan, _ = _mlp_2d_plan("modulelist", slice_before_reduce=True)
    assert plan.estimates.objective == pytest.approx(alpa.estimates.objective - 3 * (64 - 7.4))
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert (counts["all_reduce"], counts["all_gather"], counts["total"]) == (6, 3, 9), counts


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_mlp_2d_mesh_without_all_gather(spelling):
    """Alpa's plan: all of Alpa's assertions hold (21,078: the column-parallel layers'
    biases are reduced at their half size, Alpa's formula prices them whole)."""
    model, plan, expected = _mlp_2d_plan(spelling, allow_all_gather=False)
    assert_close(plan.estimates.objective, expected)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == 6 and counts["total"] == 6, counts
    _assert_replicated_megatron(model, plan, mlp_weight_names(model))


def _assert_2d_reduce_scatter_states(plan):
    """Alpa's prefer_reduce_scatter on a 2D mesh: every optimizer state of rank 2 or more
    (ours follow their parameters) split on both axes."""
    for p in plan.parameters:
        if len(p.shape) > 1:
            assert all(isinstance(x, Shard) for x in p.placements), (p.name, p.placements)


def _assert_2d_reduce_scatter_counts(plan, activation_all_reduces):
    """Alpa's prefer_reduce_scatter on a 2D mesh: the activations' all-reduces alone, two
    reduce-scatters ("for two tensor dimensions": XLA combines them per scatter dim), at
    most two all-gathers, nothing else. The column-parallel biases' gradients are
    reduce-scattered too, into a nested strided shard (``NESTED``)."""
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == activation_all_reduces, counts
    assert counts["reduce_scatter"] == 2, counts
    assert counts["all_gather"] <= 2, counts
    assert counts["total"] == sum(counts[k] for k in ("all_reduce", "reduce_scatter",
                                                      "all_gather")), counts


NESTED = (strided(0, 2), Shard(0))
"""How Alpa's rewrite stores a column-parallel bias on (2, 2): its one dim, which the
model axis 1 splits, split on the batch axis 0 within each of axis 1's pieces (DTensor's
``(_StridedShard(0, split_factor=2), Shard(0))``), so its gradient is reduce-scattered
on axis 0 and forward gathers it on axis 0 alone."""


def _assert_column_biases_nested(plan, count):
    """The biases of the ``count`` column-parallel kernels (dim 0 split on axis 1) are
    stored ``NESTED``."""
    layouts = {p.name: p.placements for p in plan.parameters}
    column = [n[:-len("weight")] + "bias" for n, p in layouts.items()
              if n.endswith(".weight") and len(p) == 2 and p[1] == Shard(0)
              and n[:-len("weight")] + "bias" in layouts]
    assert len(column) == count, layouts
    for name in column:
        assert layouts[name] == NESTED, (name, layouts[name])


def test_mlp_2d_mesh_reduce_scatter():
    """Alpa's test_n_layer_mlp_2d_mesh_reduce_scatter (``prefer_reduce_scatter``: the
    ILP's Megatron plan, then the gradients' all-reduces on axis 0 rewritten into
    reduce-scatters, ``passes/sharding/gradient_scatter.py``): the objective (the ILP's,
    21,078 vs Alpa's 21,265), the kernels' states split on both axes, 2 reduce-scatters
    and 2 all-gathers (one dim each for the column- and the row-parallel kernels; the
    column-parallel biases' dim 0 goes with the row-parallel kernels'), and Alpa's 5
    all-reduces, the activations' alone: the column-parallel biases are stored as a nested
    strided shard (``NESTED``), their gradients reduce-scattered."""
    _, plan, expected = _mlp_2d_plan("modulelist", prefer_reduce_scatter=True)
    assert_close(plan.estimates.objective, expected)
    _assert_2d_reduce_scatter_states(plan)
    _assert_2d_reduce_scatter_counts(plan, activation_all_reduces=5)
    _assert_column_biases_nested(plan, 3)


def test_mlp_2d_mesh_reduce_scatter_alpa_all_reduces():
    """Alpa's count of all-reduces in test_n_layer_mlp_2d_mesh_reduce_scatter: the
    activations' alone (the column-parallel biases' gradients reduce-scattered into a
    nested strided shard)."""
    _, plan, _ = _mlp_2d_plan("modulelist", prefer_reduce_scatter=True)
    assert communication(plan, ignore_scalar_all_reduce=True)["all_reduce"] == 5


def test_mlp_2d_mesh_zero2_reduce_scatters_activations_too():
    """``Zero2Parallel`` in Alpa's 2D space is not Alpa's ``prefer_reduce_scatter``: its
    ILP prices reduce-scatters itself and also reduce-scatters and gathers activations on
    axis 1 (sequence-parallel style), below Alpa's plan (20,898) with more collectives."""
    _, ours, _ = _mlp_2d_plan("modulelist", prefer_reduce_scatter=True)
    _, plan, _ = _mlp_2d_plan("modulelist", method=Zero2Parallel)
    assert plan.estimates.objective < ours.estimates.objective
    _assert_2d_reduce_scatter_states(plan)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["reduce_scatter"] > 2, counts


@pytest.mark.slow
def test_mlp_2d_mesh_unrestricted_is_no_worse(spelling="modulelist"):
    """Without Alpa's 2D restrictions the plan may only get cheaper (here it does: the
    batch split over both axes for some layers)."""
    model, batch = _mlp(spelling, 6, 256, 32)
    free, _ = plan_of(model, batch, shape=(2, 2), beta=(1, 0.1))
    alpa, _ = plan_of(model, batch, shape=(2, 2), beta=(1, 0.1), force_batch_dim_to_mesh_dim=0,
                      allow_mixed_mesh_shape=False)
    assert free.estimates.objective <= alpa.estimates.objective + 1e-6


@pytest.mark.parametrize("shape", [(4, 1), (2, 2)])
def test_mlp_force_data_parallel(shape):
    model, batch = _mlp("modulelist", 6, 32, 256)
    plan, mesh = plan_of(model, batch, shape=shape, force_data_parallel=True,
                         all_reduce_threshold=MERGE_ALL)
    flat = mesh.__class__(shape=(4,), alpha=(max(mesh.alpha),), beta=(min(mesh.beta),))
    assert plan.mesh_shape == (4,)
    expected = _data_parallel_objective(model, flat, 0)
    assert_close(plan.estimates.objective, expected)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == 1 and counts["total"] == 1, counts
    for placements in weights(plan).values():
        assert placements == (Replicate(),)


@pytest.mark.parametrize("shape", [(4, 1), (2, 2), (1, 4)])
def test_data_parallel_method_is_ddp(shape):
    """DataParallel: gradients all-reduced over the flattened mesh, nothing else."""
    model, batch = _mlp("modulelist", 6, 32, 256)
    plan, mesh = plan_of(model, batch, shape=shape, method=DataParallel)
    kinds = {c.kind for c in plan.collectives}
    assert kinds == {"all_reduce"}
    assert plan.mesh_shape == (4,)
    assert len(plan.collectives) == sum(1 for _ in model.parameters()) + 1   # + the loss


def test_mlp_force_batch_dim_mapping():
    num_layers, batch_size, hidden = 6, 32, 256
    model, batch = _mlp("modulelist", num_layers, batch_size, hidden)
    # data parallel on (4, 1)
    plan, mesh = plan_of(model, batch, shape=(4, 1), force_batch_dim_to_mesh_dim=0,
                         all_reduce_threshold=MERGE_ALL)
    assert_close(plan.estimates.objective, _data_parallel_objective(model, mesh, 0))
    assert communication(plan, ignore_scalar_all_reduce=True)["total"] == 1
    # model parallel on (1, 4): the batch "split" over an axis of one device
    plan, mesh = plan_of(model, batch, shape=(1, 4), force_batch_dim_to_mesh_dim=0)
    expected = (num_layers - 1) * all_reduce_cost(mesh, batch_size * hidden * 4, 1)
    assert_close(plan.estimates.objective, expected)


@pytest.mark.parametrize("method", [DataParallel, Zero2Parallel, Zero3Parallel])
@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
def test_presets_on_meshes_with_a_size_one_axis(method, shape):
    model, batch = _mlp("modulelist", 6, 256, 32)
    plan, _ = plan_of(model, batch, shape=shape, method=method)
    assert plan.estimates.objective > 0


@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_mlp_data_parallel_reduce_scatter(axis, shape):
    """Alpa's Zero2Parallel case: reduce-scatter of gradients, all-gather of parameters;
    the same objective as the all-reduce (plus one latency each)."""
    model, batch = _mlp("modulelist", 6, 256, 32)
    plan, mesh = plan_of(model, batch, shape=shape, method=Zero2Parallel)
    assert_close(plan.estimates.objective, _data_parallel_objective(model, mesh, axis))
    # Alpa's counts after XLA's combiners: the gradients' reduce-scatters in one, the
    # parameters' all-gathers in one (ours issues them per tensor; communication() merges)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert (counts["reduce_scatter"], counts["all_gather"], counts["all_reduce"],
            counts["total"]) == (1, 1, 0, 2), counts
    # optimizer states (which follow the parameters) all sharded
    for name, placements in weights(plan).items():
        assert placements[axis] == Shard(0), (name, placements)


# Alpa's reduce-scatter cases set ``prefer_reduce_scatter`` (its rewrite after the ILP); ours
# also has reduce-scatters priced inside the ILP (``allow_reduce_scatter``): both are checked
REDUCE_SCATTER = ["prefer_reduce_scatter", "allow_reduce_scatter"]


@pytest.mark.parametrize("knob", REDUCE_SCATTER)
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_mlp_model_parallel_reduce_scatter(axis, shape, knob):
    """Alpa's test_n_layer_mlp_model_parallel_reduce_scatter: with reduce-scatter
    preferred (or allowed) the model-parallel plan is unchanged (5 all-reduces; as many
    reduce-scatters as all-gathers, here none: no gradient is all-reduced, the batch is
    whole)."""
    num_layers, batch_size, hidden = 6, 32, 256
    model, batch = _mlp("modulelist", num_layers, batch_size, hidden)
    plan, mesh = plan_of(model, batch, shape=shape, all_reduce_threshold=MERGE_ALL,
                         **{knob: True})
    assert_close(plan.estimates.objective,
                 (num_layers - 1) * all_reduce_cost(mesh, batch_size * hidden * 4, axis))
    counts = communication(plan)
    assert counts["all_reduce"] + counts["reduce_scatter"] == num_layers - 1, counts
    assert counts["reduce_scatter"] == counts["all_gather"], counts
    assert counts["total"] == sum(counts[k] for k in ("all_reduce", "reduce_scatter",
                                                      "all_gather")), counts
    layouts = weights(plan)
    for k, name in enumerate(mlp_weight_names(model)):
        assert layouts[name][axis] == (Shard(0) if k % 2 == 0 else Shard(1)), name


@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_mlp_data_parallel_zero_stage_3(axis, shape):
    """Accounting difference: Alpa's ZeRO-3 objective is the data-parallel one, because
    XLA adds the second all-gather of each parameter (in backward) after the ILP. Ours
    prices that gather in the plan: each weight is gathered in forward and again for the
    backward matmul that needs it (not the first layer's, which computes no input
    gradient); biases once; gradients reduce-scattered."""
    model, batch = _mlp("modulelist", 6, 256, 32)
    plan, mesh = plan_of(model, batch, shape=shape, method=Zero3Parallel)
    n = mesh.shape[axis]

    def gather(p):
        return mesh.alpha[axis] + mesh.beta[axis] * (n - 1) / n * p.numel() * 4

    regather = sum(gather(p) for name, p in model.named_parameters()
                   if name.endswith("weight") and not name.startswith("layers.0."))
    data_parallel = _data_parallel_objective(model, mesh, axis)
    # a reduce-scatter and an all-gather cost one latency more than an all-reduce
    expected = data_parallel + len(list(model.parameters())) * mesh.alpha[axis] + regather
    assert plan.estimates.objective == pytest.approx(expected + _loss_all_reduce(mesh, axis))
    # Alpa's counts after XLA's combiners (threshold (32*32+32)*6*4: every parameter in
    # one): one all-gather in forward, one in backward, one reduce-scatter; ours issues
    # 12 + 5 gathers and 12 reduce-scatters, one per tensor (communication() merges them)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert (counts["all_gather"], counts["reduce_scatter"], counts["all_reduce"]) == (2, 1, 0)
    for name, placements in weights(plan).items():
        assert placements[axis] == Shard(0), (name, placements)


@pytest.mark.parametrize("axis, shape", [(0, (4, 1)), (1, (1, 4))])
def test_mlp_data_parallel_zero_stage_3_alpa_objective(axis, shape):
    """Alpa's force_zero_stage_3 spelled as Alpa sets it (``force_data_parallel`` and
    ``prefer_reduce_scatter``, parameters gathered in forward and again in backward):
    its ILP plans data parallel and the rewrite after it makes the reduce-scatters and
    gathers, so the objective is the data-parallel one (38,035: Alpa's 38,028 and our
    loss all-reduce) while the plan's step estimate prices the gathers (53,412, as
    ``Zero3Parallel``'s objective does: test_mlp_data_parallel_zero_stage_3). Every
    assertion of Alpa's test holds: the objective, (2, 1, 0) all-gathers,
    reduce-scatters and all-reduces, every parameter split."""
    model, batch = _mlp("modulelist", 6, 256, 32)
    plan, mesh = plan_of(model, batch, shape=shape, force_data_parallel=True,
                         prefer_reduce_scatter=True, rematerialize_parameters=True)
    assert_close(plan.estimates.objective, _data_parallel_objective(model, mesh, axis))
    zero3, _ = plan_of(model, batch, shape=shape, method=Zero3Parallel)
    assert plan.estimates.step_time_s == pytest.approx(zero3.estimates.objective)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert (counts["all_gather"], counts["reduce_scatter"], counts["all_reduce"]) == (2, 1, 0)
    for name, placements in weights(plan).items():
        assert placements == (Shard(0),), (name, placements)


# -- test_bert.py ---------------------------------------------------------------------------

BERT_QKV = ["fused_minor", "separate", "fused_major"]


@pytest.mark.slow
@pytest.mark.parametrize("qkv", ["fused_minor", "separate"])
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_bert_layer_data_parallel(qkv, axis, shape):
    model = BertLayers(2, 32, 8, qkv)
    plan, mesh = plan_of(model, bert_inputs(64, 64, 32), shape=shape,
                         all_reduce_threshold=MERGE_ALL)
    expected = _data_parallel_objective(model, mesh, axis)
    assert_close(plan.estimates.objective, expected)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == 1 and counts["total"] == 1, counts


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["matmul", "sdpa"])
@pytest.mark.parametrize("qkv", BERT_QKV)
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_bert_layer_model_parallel(qkv, attention, axis, shape):
    num_layers, batch_size, seq_len, hidden = 2, 8, 8, 128
    model = BertLayers(num_layers, hidden, 8, qkv, attention)
    plan, mesh = plan_of(model, bert_inputs(batch_size, seq_len, hidden), shape=shape,
                         all_reduce_threshold=MERGE_ALL)
    expected = (num_layers * 4 - 1) * all_reduce_cost(
        mesh, batch_size * seq_len * hidden * 4, axis)
    assert_close(plan.estimates.objective, expected)
    counts = communication(plan)
    assert counts["all_reduce"] == num_layers * 4 - 1 and counts["total"] == num_layers * 4 - 1, \
        counts
    layouts = weights(plan)
    for k in range(num_layers):
        names = bert_matmul_weights(model, k)
        pattern = [0] * (len(names) - 3) + [1, 0, 1]     # column, row, column, row
        for name, j in zip(names, pattern):
            want = Shard(0) if j == 0 else Shard(1)
            if qkv == "fused_major" and name.endswith("qkv.weight"):
                want = strided(0, 3)   # (3, H)-major: each device its heads of q, k and v
            assert layouts[name][axis] == want, (name, layouts[name])


@pytest.mark.slow
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_bert_layer_with_alpas_dropout(axis, shape):
    """Alpa's BERT tests run Flax's BERT with dropout (``deterministic=False``: rate 0.1 on
    the attention probabilities and both dense outputs), which the other BERT cases here
    leave out. With it the plans are the same: data parallel at Alpa's size for it (one
    merged all-reduce), model parallel at its size for that (7 all-reduces); each device
    draws its own block of every mask (``random="sharded"``)."""
    model = BertLayers(2, 32, 8, dropout=0.1)
    plan, mesh = plan_of(model, bert_inputs(64, 64, 32), shape=shape,
                         all_reduce_threshold=MERGE_ALL)
    assert_close(plan.estimates.objective, _data_parallel_objective(model, mesh, axis))
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == counts["total"] == 1, counts
    plan, mesh = plan_of(BertLayers(2, 128, 8, dropout=0.1), bert_inputs(8, 8, 128),
                         shape=shape, all_reduce_threshold=MERGE_ALL)
    assert_close(plan.estimates.objective, 7 * all_reduce_cost(mesh, 8 * 8 * 128 * 4, axis))
    counts = communication(plan)
    assert counts["all_reduce"] == counts["total"] == 7, counts


@pytest.mark.slow
@pytest.mark.parametrize("knob", REDUCE_SCATTER)
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_bert_layer_model_parallel_reduce_scatter(axis, shape, knob):
    """Alpa's test_bert_layer_model_parallel_reduce_scatter: with reduce-scatters
    preferred (or in the space) the model-parallel plan is unchanged (7 all-reduces,
    nothing else)."""
    num_layers, batch_size, seq_len, hidden = 2, 8, 8, 128
    plan, mesh = plan_of(BertLayers(num_layers, hidden, 8), bert_inputs(batch_size, seq_len, hidden),
                         shape=shape, all_reduce_threshold=MERGE_ALL, **{knob: True})
    assert_close(plan.estimates.objective, (num_layers * 4 - 1) * all_reduce_cost(
        mesh, batch_size * seq_len * hidden * 4, axis))
    counts = communication(plan)
    assert counts["all_reduce"] == counts["total"] == num_layers * 4 - 1, counts


@pytest.mark.slow
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_bert_layer_model_parallel_remat(axis, shape):
    """Alpa's test_bert_layer_model_parallel_remat: each layer checkpointed (``remat=
    "full"``, Alpa's ``gradient_checkpointing``), so backward recomputes the layer's
    forward with its 2 all-reduces: 11 all-reduces (6 per layer, less the first layer's
    input gradient), nothing else."""
    num_layers, batch_size, seq_len, hidden = 2, 8, 8, 128
    plan, mesh = plan_of(BertLayers(num_layers, hidden, 8), bert_inputs(batch_size, seq_len, hidden),
                         shape=shape, all_reduce_threshold=MERGE_ALL, remat="full")
    assert_close(plan.estimates.objective, (num_layers * 6 - 1) * all_reduce_cost(
        mesh, batch_size * seq_len * hidden * 4, axis))
    counts = communication(plan)
    assert counts["all_reduce"] == counts["total"] == num_layers * 6 - 1, counts


@pytest.mark.slow
def test_bert_layer_force_batch_dim_mapping():
    """Alpa's test_bert_layer_force_batch_dim_mapping: the batch on axis 0 alone, so on
    (1, 4) it stays whole and the plan is model parallel (5,505,031; before the batch was
    kept off the other axes it split there, 152,472), with batch 1 too."""
    model = BertLayers(2, 32, 8)
    plan, mesh = plan_of(model, bert_inputs(64, 64, 32), shape=(4, 1),
                         all_reduce_threshold=MERGE_ALL, force_batch_dim_to_mesh_dim=0)
    assert_close(plan.estimates.objective, _data_parallel_objective(model, mesh, 0))
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == 1 and counts["total"] == 1, counts
    for batch_size in (64, 1):
        plan, mesh = plan_of(model, bert_inputs(batch_size, 64, 32), shape=(1, 4),
                             all_reduce_threshold=MERGE_ALL, force_batch_dim_to_mesh_dim=0)
        expected = 7 * all_reduce_cost(mesh, batch_size * 64 * 32 * 4, 1)
        assert_close(plan.estimates.objective, expected)


@functools.cache
def _bert_2d_plan(**options):
    num_layers, batch_size, seq_len, hidden = 2, 8, 8, 128
    model = BertLayers(num_layers, hidden, 8)
    plan, mesh = plan_of(model, bert_inputs(batch_size, seq_len, hidden), shape=(2, 2),
                         alpha=(2, 2), beta=(1, 0.1), all_reduce_threshold=MERGE_ALL,
                         **{**ALPA_2D, **options})
    expected = (sum(all_reduce_cost(mesh, p.numel() * 4 / 2, 0) for p in model.parameters())
                + (num_layers * 4 - 1)
                * all_reduce_cost(mesh, batch_size * seq_len * hidden * 4 / 2, 1))
    return model, plan, expected


def _assert_bert_2d(model, plan, expected):
    assert_close(plan.estimates.objective, expected)
    assert communication(plan, ignore_scalar_all_reduce=True)["all_reduce"] == 8
    for k in range(2):
        _assert_replicated_megatron(model, plan, bert_matmul_weights(model, k))


@pytest.mark.slow
def test_bert_layer_2d_mesh():
    """Alpa's test_bert_layer_2d_mesh (alpha 2, beta (1, 0.1)), every assertion: the
    objective (807,697 vs Alpa's 804,619), 8 all-reduces (7 activations on axis 1, the
    gradients merged on axis 0) and nothing else, Megatron on axis 1."""
    model, plan, expected = _bert_2d_plan()
    _assert_bert_2d(model, plan, expected)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["total"] == counts["all_reduce"] == 8, counts


@pytest.mark.slow
def test_bert_layer_2d_mesh_reduce_scatter():
    """Alpa's test_bert_layer_2d_mesh_reduce_scatter (``prefer_reduce_scatter``): the
    objective (the ILP's, 807,697 vs Alpa's 804,619), every kernel's states split on both
    axes, 2 reduce-scatters, 2 all-gathers, and Alpa's 7 all-reduces, the activations'
    alone: the column-parallel biases (q/k/v, intermediate) are stored as a nested strided
    shard (``NESTED``), their gradients reduce-scattered. The plan trains like one device
    on 4 gloo ranks (``tests/test_alpa_runs.py``)."""
    _, plan, expected = _bert_2d_plan(prefer_reduce_scatter=True)
    assert_close(plan.estimates.objective, expected)
    _assert_2d_reduce_scatter_states(plan)
    _assert_2d_reduce_scatter_counts(plan, activation_all_reduces=7)
    _assert_column_biases_nested(plan, 4)   # q/k/v and intermediate, two layers


@pytest.mark.slow
def test_bert_layer_2d_mesh_reduce_scatter_alpa_all_reduces():
    """Alpa's count of all-reduces in test_bert_layer_2d_mesh_reduce_scatter."""
    _, plan, _ = _bert_2d_plan(prefer_reduce_scatter=True)
    assert communication(plan, ignore_scalar_all_reduce=True)["all_reduce"] == 7


@pytest.mark.slow
def test_bert_layer_2d_mesh_slicing_before_reduce():
    """Outside Alpa's space (``slice_before_reduce``): the layer norms' and row-parallel
    biases' gradients summed over axis 0 at half size and gathered on axis 1, cheaper in
    Alpa's own units: 4 all-gathers besides the 8 all-reduces. This plan trains like one
    device (``tests/test_alpa_runs.py``)."""
    _, alpa, _ = _bert_2d_plan()
    _, plan, _ = _bert_2d_plan(slice_before_reduce=True)
    assert plan.estimates.objective < alpa.estimates.objective - 900
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert (counts["all_reduce"], counts["all_gather"], counts["total"]) == (8, 4, 12), counts


@pytest.mark.slow
def test_bert_layer_2d_mesh_without_all_gather():
    """Alpa's plan (807,697): every assertion of Alpa's test holds."""
    model, plan, expected = _bert_2d_plan(allow_all_gather=False)
    _assert_bert_2d(model, plan, expected)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["total"] == counts["all_reduce"] == 8, counts


@pytest.mark.slow
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_bert_mlm_data_parallel(axis, shape):
    """Alpa's test_bert_mlm_data_parallel: the masked LM (tied decoder, one-hot loss)
    plans data parallel: one merged gradient all-reduce, every parameter replicated
    (57,737 against 57,730 plus our scalar all-reduces)."""
    factory = functools.partial(BertMLM, 2, 16, 4, 128, 32)
    plan, mesh = plan_of(factory, mlm_inputs(32, 32), mlm_loss, shape=shape,
                         all_reduce_threshold=MERGE_ALL)
    with torch.device("meta"):
        model = factory()
    assert_close(plan.estimates.objective, _data_parallel_objective(model, mesh, axis))
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == 1 and counts["total"] == 1, counts
    for placements in weights(plan).values():
        assert all(p == Replicate() for p in placements)


MLM_2D = dict(allow_recompute_heavy_op=True, allow_all_gather=False)   # as Alpa's test sets


@functools.cache
def _bert_mlm_2d_plan(**options):
    plan, _ = plan_of(functools.partial(BertMLM, 2, 512, 4, 4096, 4), mlm_inputs(4, 4),
                      mlm_loss, shape=(2, 2), alpha=(2, 2), beta=(1, 0.1),
                      all_reduce_threshold=MERGE_ALL, **ALPA_2D, **MLM_2D, **options)
    return plan


@pytest.mark.slow
def test_bert_mlm_2d_mesh_layouts():
    """Alpa's test_bert_mlm_2d_mesh, the assertions that hold: the word embedding
    replicated on axis 0 and split by vocabulary on axis 1, the encoder Megatron on axis 1.
    (Alpa's assertions on XLA's iota shapes have no counterpart in a plan.)"""
    plan = _bert_mlm_2d_plan()
    assert weights(plan)["word.weight"] == (Replicate(), Shard(0))
    with torch.device("meta"):
        model = BertMLM(2, 512, 4, 4096, 4)
    for k in range(2):
        names = [f"encoder.{n}" for n in bert_matmul_weights(model.encoder, k)]
        _assert_replicated_megatron(model, plan, names)


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="16 all-reduces and 1 all-to-all where Alpa has 13 "
                   "all-reduces; the transform dense column-parallel on axis 1 where Alpa "
                   "replicates it: objective 17,410,991, against 17,911,926 with Alpa's "
                   "layout pinned (transform, position and token-type tables replicated), "
                   "which has 14 (Alpa's 13 and our log-softmax backward's row statistic, "
                   "test_embedding_2d_mesh). Alpa's space lacks our plan: forward reads the "
                   "transform weight row-parallel through an all-to-all on axis 1 from the "
                   "column-parallel layout backward reads, and Alpa's ReshardingCost makes an "
                   "all-to-all infinite when both mesh axes have more than one device; the "
                   "plan trains like one device (test_alpa_runs.py, "
                   "test_bert_mlm_2d_plan_outside_alpas_space_runs_like_one_device)")
def test_bert_mlm_2d_mesh_counts():
    plan = _bert_mlm_2d_plan()
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == 4 * 2 + 2 + 2 + 1 and counts["total"] == counts["all_reduce"]
    assert all(p == Replicate() for p in weights(plan)["transform.weight"])


@pytest.mark.slow
def test_bert_mlm_2d_mesh_counts_without_all_to_all():
    """Alpa's test_bert_mlm_2d_mesh in Alpa's resharding space: its ``ReshardingCost``
    makes an all-to-all infinite on a mesh whose two axes both have more than one device
    (here ``allow_all_to_all=False``). Then the transform dense is replicated as Alpa's
    is, and the plan has Alpa's 13 all-reduces and nothing else, plus our log-softmax
    backward's row statistic (test_embedding_2d_mesh's accounting difference). Its
    objective (17,905,782) is above the default plan's, which the all-to-all alone makes
    cheaper (test_bert_mlm_2d_mesh_counts)."""
    plan = _bert_mlm_2d_plan(allow_all_to_all=False)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == counts["total"] == 4 * 2 + 2 + 2 + 1 + 1, counts
    synced = [c.tensor for c in plan.collectives if c.tensor.startswith("_log_softmax")]
    assert synced.count("_log_softmax_backward_data") == 1, synced
    assert all(p == Replicate() for p in weights(plan)["transform.weight"])
    assert plan.estimates.objective > _bert_mlm_2d_plan().estimates.objective


@pytest.mark.slow
def test_bert_mlm_2d_mesh_alpa_layout_is_dearer():
    """Alpa's layout for the head, pinned: 14 all-reduces and nothing else, dearer than
    the ILP's own plan in Alpa's units."""
    R = ("R", "R")
    alpa = _bert_mlm_2d_plan(pin=((r"transform\.weight", R), (r"(position|token_type)\.weight", R)))
    counts = communication(alpa, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == counts["total"] == 14, counts
    assert _bert_mlm_2d_plan().estimates.objective < alpa.estimates.objective


def _assert_mlm_2d_reduce_scatter_counts(counts, all_reduces):
    """Alpa's test_bert_mlm_2d_mesh_reduce_scatter, its counts: ``all_reduces`` (Alpa's
    4 * num_layers + 2 + 2), at most 3 reduce-scatters (Alpa: "the correct number should
    be 2"), at most 2 all-gathers, nothing else."""
    assert counts["all_reduce"] == all_reduces, counts
    assert counts["reduce_scatter"] <= 3 and counts["all_gather"] <= 2, counts
    assert counts["total"] == sum(counts[k] for k in ("all_reduce", "reduce_scatter",
                                                      "all_gather")), counts


@pytest.mark.slow
@pytest.mark.xfail(strict=True, reason="15 all-reduces and 1 all-to-all where Alpa has 12 "
                   "all-reduces and nothing else (2 reduce-scatters, 2 all-gathers: within "
                   "Alpa's bounds): the ILP's plan is test_bert_mlm_2d_mesh_counts' (the "
                   "transform dense column-parallel on axis 1, read row-parallel through an "
                   "all-to-all Alpa's ReshardingCost forbids on a 2D mesh, with 2 more "
                   "all-reduces), rewritten; with all-to-all forbidden Alpa's counts "
                   "hold but for our log-softmax backward's row statistic "
                   "(test_bert_mlm_2d_mesh_reduce_scatter_without_all_to_all)")
def test_bert_mlm_2d_mesh_reduce_scatter_counts():
    """Alpa's test_bert_mlm_2d_mesh_reduce_scatter (test_bert_mlm_2d_mesh with
    ``prefer_reduce_scatter``), its counts as Alpa asserts them."""
    plan = _bert_mlm_2d_plan(prefer_reduce_scatter=True)
    _assert_mlm_2d_reduce_scatter_counts(communication(plan, ignore_scalar_all_reduce=True),
                                         4 * 2 + 2 + 2)


@pytest.mark.slow
def test_bert_mlm_2d_mesh_reduce_scatter_without_all_to_all():
    """The same in Alpa's resharding space (``allow_all_to_all=False``, as in
    test_bert_mlm_2d_mesh_counts_without_all_to_all): Alpa's 12 all-reduces plus our
    log-softmax backward's row statistic, 2 reduce-scatters, 2 all-gathers, nothing
    else; the objective is the ILP's, as without the option."""
    plan = _bert_mlm_2d_plan(prefer_reduce_scatter=True, allow_all_to_all=False)
    _assert_mlm_2d_reduce_scatter_counts(communication(plan, ignore_scalar_all_reduce=True),
                                         4 * 2 + 2 + 2 + 1)
    synced = [c.tensor for c in plan.collectives if c.tensor.startswith("_log_softmax")]
    assert synced.count("_log_softmax_backward_data") == 1, synced
    assert plan.estimates.objective == _bert_mlm_2d_plan(allow_all_to_all=False).estimates.objective


@pytest.mark.slow
@pytest.mark.parametrize("all_to_all", [True, False])
def test_bert_mlm_2d_mesh_reduce_scatter_states(all_to_all):
    """Alpa's test_bert_mlm_2d_mesh_reduce_scatter, its layouts: at most 2 optimizer
    states of rank 2 or more not split on both mesh axes (Alpa's "allow the
    token_type_embeddings not partitioned"; ours follow their parameters, 2 Adam moments
    each). Ours splits the token-type table (on its hidden dim on axis 0); the one left is
    the transform dense's with all-to-all forbidden (split on axis 0 alone), none with it."""
    plan = _bert_mlm_2d_plan(prefer_reduce_scatter=True, allow_all_to_all=all_to_all)
    not_split = [p.name for p in plan.parameters
                 if len(p.shape) > 1 and not all(isinstance(x, Shard) for x in p.placements)]
    assert 2 * len(not_split) <= 2, not_split
    assert weights(plan)["token_type.weight"] == (Shard(1), Shard(0))


@functools.cache
def _zero2_plan(case, shape, pin=()):
    """Alpa's ``prefer_reduce_scatter`` on a data-parallel plan is ZeRO-2 (its MLP test
    says so with ``Zero2Parallel``): gradients reduce-scattered, parameters gathered."""
    if case == "bert":
        factory = functools.partial(BertLayers, 2, 32, 8)
        batch, loss = bert_inputs(64, 64, 32), mse
    else:
        factory = functools.partial(BertMLM, 2, 16, 4, 128, 32)
        batch, loss = mlm_inputs(32, 32), mlm_loss
    plan, mesh = plan_of(factory, batch, loss, shape=shape, method=Zero2Parallel,
                         all_reduce_threshold=MERGE_ALL, **({"pin": pin} if pin else {}))
    with torch.device("meta"):
        model = factory()
    return model, plan, mesh


@pytest.mark.slow
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_bert_layer_data_parallel_reduce_scatter(axis, shape):
    """Alpa's test_bert_layer_data_parallel_reduce_scatter: the data-parallel objective
    (one latency more per parameter: 153,279 against 152,472), one reduce-scatter, one
    all-gather (each parameter gathered once, forward's and backward's reads sharing the
    copy, as XLA's CSE merges Alpa's gathers), no all-reduce, every parameter (and so its
    optimizer states) sharded."""
    model, plan, mesh = _zero2_plan("bert", shape)
    assert_close(plan.estimates.objective, _data_parallel_objective(model, mesh, axis))
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert (counts["reduce_scatter"], counts["all_gather"], counts["all_reduce"],
            counts["total"]) == (1, 1, 0, 2), counts
    for name, placements in weights(plan).items():
        assert placements[axis] == Shard(0), (name, placements)
    # every parameter is gathered once: one reshard with steps per parameter
    params = {p.node for p in plan.parameters}
    gathered = [r for r in plan.reshards if r.producer in params and r.steps]
    assert len({r.producer for r in gathered}) == len(gathered), gathered


@pytest.mark.slow
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_bert_layer_data_parallel_prefer_reduce_scatter(axis, shape):
    """Alpa's test_bert_layer_data_parallel_reduce_scatter with its own knob,
    ``prefer_reduce_scatter`` (the test above plans ``Zero2Parallel``): the ILP's
    data-parallel plan rewritten after it, so the objective is the data-parallel one
    (152,479: Alpa's formula and our loss all-reduce), one reduce-scatter, one all-gather,
    no all-reduce, every parameter (and so its optimizer states) split."""
    model = BertLayers(2, 32, 8)
    plan, mesh = plan_of(model, bert_inputs(64, 64, 32), shape=shape,
                         all_reduce_threshold=MERGE_ALL, prefer_reduce_scatter=True)
    expected = _data_parallel_objective(model, mesh, axis)
    assert_close(plan.estimates.objective, expected)
    assert plan.estimates.objective == pytest.approx(expected + _loss_all_reduce(mesh, axis))
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert (counts["reduce_scatter"], counts["all_gather"], counts["all_reduce"],
            counts["total"]) == (1, 1, 0, 2), counts
    for name, placements in weights(plan).items():
        assert placements[axis] == Shard(0), (name, placements)


@pytest.mark.slow
def test_bert_mlm_data_parallel_prefer_reduce_scatter():
    """Alpa's test_bert_mlm_data_parallel_reduce_scatter with its own knob: the objective
    is the ILP's data-parallel one (57,737), and the counts differ from Alpa's as
    ``Zero2Parallel``'s do (test_bert_mlm_data_parallel_reduce_scatter): the token-type
    table's 2 rows do not split over 4 devices, and where Alpa's rewrite leaves it whole
    and all-reduced (Alpa: 1 reduce-scatter, 1 all-gather, 1 all-reduce) ours splits it on
    its hidden dim (2, 2 and 0: a reduce-scatter and a gather on dim 1 besides the others'
    on dim 0)."""
    factory = functools.partial(BertMLM, 2, 16, 4, 128, 32)
    plan, mesh = plan_of(factory, mlm_inputs(32, 32), mlm_loss, shape=(4, 1),
                         all_reduce_threshold=MERGE_ALL, prefer_reduce_scatter=True)
    with torch.device("meta"):
        model = factory()
    assert_close(plan.estimates.objective, _data_parallel_objective(model, mesh, 0))
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert (counts["reduce_scatter"], counts["all_gather"], counts["all_reduce"],
            counts["total"]) == (2, 2, 0, 4), counts
    layouts = weights(plan)
    assert layouts["token_type.weight"] == (Shard(1), Replicate())
    assert all(placements[0] != Replicate() for placements in layouts.values())


@pytest.mark.slow
def test_bert_mlm_data_parallel_reduce_scatter():
    """Alpa's test_bert_mlm_data_parallel_reduce_scatter: the data-parallel objective
    within 1% (57,778 against 57,730; the tied word embedding read by the embedding and
    the head shares one gathered copy), the optimizer states sharded.

    The counts differ by construction: Alpa all-reduces the token-type table's gradient
    whole (its 2 rows do not split over 4 devices, and Alpa's reduce-scatter pass leaves
    it; its test allows one such parameter and then asserts 1 all-reduce, 1
    reduce-scatter, 1 all-gather). Ours reduce-scatters it on its hidden dim: 0
    all-reduces, and a reduce-scatter and a gather on dim 1 besides the others' on dim 0,
    which XLA's combiners would not merge with them. With the table pinned whole, Alpa's
    counts hold."""
    model, plan, mesh = _zero2_plan("mlm", (4, 1))
    assert_close(plan.estimates.objective, _data_parallel_objective(model, mesh, 0))
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert (counts["reduce_scatter"], counts["all_gather"], counts["all_reduce"],
            counts["total"]) == (2, 2, 0, 4), counts
    layouts = weights(plan)
    assert layouts["token_type.weight"] == (Shard(1), Replicate())
    assert all(placements[0] != Replicate() for placements in layouts.values())
    _, pinned, _ = _zero2_plan("mlm", (4, 1), pin=((r"token_type\.weight", ("R", "R")),))
    counts = communication(pinned, ignore_scalar_all_reduce=True)
    assert (counts["reduce_scatter"], counts["all_gather"], counts["all_reduce"],
            counts["total"]) == (1, 1, 1, 3), counts
    assert_close(pinned.estimates.objective, _data_parallel_objective(model, mesh, 0))


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(4, 1), (1, 4)])
def test_bert_mlm_data_parallel_zero_stage_3(shape):
    """Alpa's test_bert_mlm_data_parallel_reduce_scatter_zero_3: at most 3 parameters and
    optimizer states of rank 2 or more left whole (ours leaves none: the token-type table
    is split on its hidden dim); and, as in the MLP's ZeRO-3 case, one phase of gathers
    in forward, one in backward, one of reduce-scatters (Alpa's 2, 1 and 0). Ours has one
    more gather (in forward) and one more reduce-scatter, of the token-type table on its
    hidden dim, which XLA's combiners would not merge with the others' on dim 0 (see
    test_bert_mlm_data_parallel_reduce_scatter)."""
    plan, _ = plan_of(functools.partial(BertMLM, 2, 16, 4, 128, 32), mlm_inputs(32, 32),
                      mlm_loss, shape=shape, method=Zero3Parallel, all_reduce_threshold=MERGE_ALL)
    ranks = {p.name: len(p.shape) for p in plan.parameters}
    whole = [name for name, placements in weights(plan).items()
             if ranks[name] > 1 and all(p == Replicate() for p in placements)]
    assert 3 * len(whole) <= 3, whole        # each with its two Adam states
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert (counts["all_gather"], counts["reduce_scatter"], counts["all_reduce"]) == (3, 2, 0), \
        counts
    assert weights(plan)["token_type.weight"][shape.index(4)] == Shard(1)


def _tied_embedding_case(head="matmul"):
    """The model as a factory: built on ``meta`` it stays tied (``Module.to("meta")`` of a
    CPU model gives each module its own copy of a shared parameter)."""
    vocab, hidden, batch_size, seq_len = 1024, 8, 8, 8
    x = torch.zeros(batch_size, seq_len, dtype=torch.int64)
    return (lambda: TiedEmbedding(vocab, hidden, head)), (x, x), \
        (vocab, hidden, batch_size, seq_len)


# Alpa's spelling, then a tied nn.Linear head with the loss as log_softmax + nll_loss
EMBEDDING_SPELLINGS = [("matmul", summed_cross_entropy),
                       ("linear", summed_nll_of_log_softmax)]


@pytest.mark.slow
@pytest.mark.parametrize("head,loss_fn", EMBEDDING_SPELLINGS, ids=["matmul", "linear_nll"])
def test_embedding_2d_mesh(head, loss_fn):
    """Vocab-parallel embedding and cross entropy (Megatron's): the table split by rows
    on axis 1, the batch on axis 0 (Alpa's 2D search space), the logits stay split through
    log-softmax (row max and sum all-reduced, ``runtime/lowering/synced.py``) and the target pick.

    Accounting difference: our backward all-reduces one more row statistic (the row sum
    of the incoming gradient, ``grad - exp(y) * sum(grad)``), where XLA's plan computes the
    one-hot gradient whole and sums it locally: 129 units, 0.7% (within Alpa's 1%); and the
    scalar loss's all-reduce on both axes."""
    model, batch, (vocab, hidden, batch_size, seq_len) = _tied_embedding_case(head)
    plan, mesh = plan_of(model, batch, loss_fn, shape=(2, 2),
                         force_batch_dim_to_mesh_dim=0, allow_mixed_mesh_shape=False)
    row_stat = all_reduce_cost(mesh, batch_size * seq_len * 4 / 2, 1)
    expected = (all_reduce_cost(mesh, vocab * hidden * 4 / 2, 0)
                + 2 * all_reduce_cost(mesh, batch_size * seq_len * hidden * 4 / 2, 1)
                + 2 * row_stat)
    assert_close(plan.estimates.objective, expected)
    ours = expected + row_stat + _loss_all_reduce(mesh, 0) + _loss_all_reduce(mesh, 1)
    assert plan.estimates.objective == pytest.approx(ours)
    assert communication(plan)["total"] == communication(plan)["all_reduce"]
    assert weights(plan)["embed.weight"] == (Replicate(), Shard(0))
    synced = sorted((c.tensor, c.reduce_op) for c in plan.collectives
                    if c.tensor.startswith("_log_softmax"))
    assert synced == [("_log_softmax", "max"), ("_log_softmax", "sum"),
                      ("_log_softmax_backward_data", "sum")]


@pytest.mark.slow
def test_embedding_2d_mesh_unrestricted_is_no_worse():
    """Outside Alpa's 2D space the planner finds a cheaper plan: the vocabulary split
    over both axes (9,748 here)."""
    model, batch, _ = _tied_embedding_case()
    free, _ = plan_of(model, batch, summed_cross_entropy, shape=(2, 2))
    alpa, _ = plan_of(model, batch, summed_cross_entropy, shape=(2, 2),
                      force_batch_dim_to_mesh_dim=0, allow_mixed_mesh_shape=False)
    assert free.estimates.objective <= alpa.estimates.objective + 1e-6


# -- test_conv.py ---------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_conv_data_parallel(axis, shape):
    """Synchronized batch norm (rules/norm.py, runtime/lowering/sync_norm.py): the batch splits and
    each BatchNorm all-reduces its per-channel sums, (sum x, sum x^2) in forward and
    (sum dy, sum dy x_hat) in backward. Accounting difference: Alpa's formula prices every
    parameter's gradient all-reduce plus 4 statistics all-reduces of C values per
    BatchNorm; ours reduces 2C values twice, and those backward sums are the BatchNorm
    weight and bias gradients, so they need no all-reduce of their own (4.9% cheaper,
    inside Alpa's 5% tolerance)."""
    num_layers, batch_size, image, channel = 3, 16, 16, 4
    model = ConvNet(num_layers, channel)
    plan, mesh = plan_of(model, conv_inputs(num_layers, batch_size, image, channel),
                         shape=shape, all_reduce_threshold=MERGE_ALL)
    weight_sync = _data_parallel_objective(model, mesh, axis)
    batch_norm_sync = 2 * 2 * num_layers * all_reduce_cost(mesh, channel * 4, axis)
    assert_close(plan.estimates.objective, weight_sync + batch_norm_sync, rtol=0.05)
    # our exact figure: conv weight gradients, 2 all-reduces of 2C per BatchNorm, the loss
    conv_sync = sum(all_reduce_cost(mesh, p.numel() * 4, axis)
                    for name, p in model.named_parameters() if p.ndim == 4)
    ours = conv_sync + 2 * num_layers * all_reduce_cost(mesh, 2 * channel * 4, axis)
    assert plan.estimates.objective == pytest.approx(ours + _loss_all_reduce(mesh, axis))
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == 1 + 2 * num_layers and counts["total"] == counts["all_reduce"]
    assert sum(1 for s in plan.strategies if s.batch_syncs) == 2 * num_layers
    for placements in weights(plan).values():
        assert all(p == Replicate() for p in placements)


@pytest.mark.slow
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_conv_model_parallel(axis, shape):
    """Alpa asserts the count only: 3 all-reduces. Layers 1 and 3 contract their input
    channels, and BatchNorm reads each partial output whole in forward and again in
    backward: one all-reduce serves both reads (``Reshard.same_as``, as XLA's CSE after
    Alpa's ILP), plus layer 1's input gradient. Accounting difference: Alpa's ILP prices
    each read (614,405 in its units, the figure we had before sharing); ours prices one
    all-reduce per value and layout, what runs."""
    num_layers, batch_size, image, channel = 4, 8, 16, 256
    model = ConvNet(num_layers, channel)
    plan, mesh = plan_of(model, conv_inputs(num_layers, batch_size, image, channel),
                         shape=shape, all_reduce_threshold=MERGE_ALL)

    def output(layer):    # bytes of a layer's conv output
        side = image // 2 ** (layer + 1)
        return batch_size * channel * side * side * 4

    ours = 2 * all_reduce_cost(mesh, output(1), axis) + all_reduce_cost(mesh, output(3), axis)
    assert plan.estimates.objective == pytest.approx(ours)
    alpa = ours + all_reduce_cost(mesh, output(1), axis) + all_reduce_cost(mesh, output(3), axis)
    assert alpa == pytest.approx(614_405)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == num_layers - 1 and counts["total"] == num_layers - 1, counts
    assert sum(1 for r in plan.reshards if r.same_as is not None) == 2


@pytest.mark.slow
def test_conv_data_parallel_reduce_scatter():
    """Alpa's test_n_layer_conv_data_parallel_reduce_scatter (``prefer_reduce_scatter``),
    every assertion: the data-parallel objective (the ILP's: 2,896, within Alpa's 5% as in
    test_conv_data_parallel), the BatchNorms' 2 all-reduces each, some reduce-scatter, at
    most 2 all-gathers, nothing else, and no optimizer state of rank 2 or more whole."""
    num_layers, batch_size, image, channel = 3, 16, 16, 4
    model = ConvNet(num_layers, channel)
    plan, mesh = plan_of(model, conv_inputs(num_layers, batch_size, image, channel),
                         shape=(4, 1), all_reduce_threshold=MERGE_ALL, prefer_reduce_scatter=True)
    weight_sync = _data_parallel_objective(model, mesh, 0)
    batch_norm_sync = 2 * 2 * num_layers * all_reduce_cost(mesh, channel * 4, 0)
    assert_close(plan.estimates.objective, weight_sync + batch_norm_sync, rtol=0.05)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == 2 * num_layers, counts
    assert counts["reduce_scatter"] > 0 and counts["all_gather"] <= 2, counts
    assert counts["total"] == sum(counts[k] for k in ("all_reduce", "reduce_scatter",
                                                      "all_gather")), counts
    assert all(p.placements[0] != Replicate() for p in plan.parameters if len(p.shape) > 1)


@functools.cache
def _conv_2d_plan(mixed: bool, reduce_scatter: bool):
    """Alpa's test_n_layer_conv_2d_mesh: 4 layers, batch 8, image 32, 8 channels on (2, 2)
    with beta (1, 0.1), in Alpa's 2D space with ``allow_mixed_mesh_shape`` as the case sets
    it."""
    num_layers, batch_size, image, channel = 4, 8, 32, 8
    plan, _ = plan_of(ConvNet(num_layers, channel),
                      conv_inputs(num_layers, batch_size, image, channel), shape=(2, 2),
                      beta=(1, 0.1), all_reduce_threshold=MERGE_ALL,
                      **{**ALPA_2D, "allow_mixed_mesh_shape": mixed},
                      prefer_reduce_scatter=reduce_scatter)
    return plan


@pytest.mark.slow
@pytest.mark.parametrize("mixed,reduce_scatter", [
    (False, False), (False, True), (True, False), (True, True)])
def test_conv_2d_mesh(mixed, reduce_scatter):
    """Alpa's test_n_layer_conv_2d_mesh and its mixed-shape and reduce-scatter variants:
    the plan exists (all Alpa asserts without either), with ``prefer_reduce_scatter`` some
    reduce-scatter, with mixed mesh shapes some all-to-all. With both, the ILP's
    all-to-all (the third conv's weight, stored ``(R, S(1))``, read ``(R, S(0))``) stays
    after the rewrite stores that weight ``(S(0), S(1))``: its read gathers on axis 0 and
    all-to-alls on axis 1 (``reshard._outer_blockers``), as Alpa's rewrite gathers on
    axis 0 and keeps the all-to-all."""
    counts = communication(_conv_2d_plan(mixed, reduce_scatter), ignore_scalar_all_reduce=True)
    if reduce_scatter:
        assert counts["reduce_scatter"] > 0, counts
    if mixed:
        assert counts["all_to_all"] > 0, counts


@pytest.mark.slow
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_depthwise_conv_model_parallel(axis, shape):
    """Alpa's test_n_layer_depthwise_conv_model_parallel: one all-reduce and nothing else
    (the batch of 4 split over the 4 devices, the merged gradients)."""
    plan, _ = plan_of(DepthwiseConvNet(256), (torch.empty(4, 256, 8, 8), torch.empty(4, 256, 8, 8)),
                      shape=shape, all_reduce_threshold=MERGE_ALL)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == counts["total"] == 1, counts


# -- test_moe.py ----------------------------------------------------------------------------

MOE = dict(batch_size=64, seq_len=16, hidden=64, heads=16, group_size=32, num_experts=16)


@functools.cache
def _moe_layer_plan(shape, **options):
    """One plan per case, shared by the tests that read it (planning takes minutes here)."""
    m = MOE
    model = MoELayer(m["hidden"], m["heads"], m["group_size"], m["num_experts"])
    return plan_of(model, bert_inputs(m["batch_size"], m["seq_len"], m["hidden"]),
                   shape=shape, all_reduce_threshold=MERGE_ALL, **options)


def _alpa_moe_layer_objective(mesh, axis):
    """Alpa's expectation: 4 all-to-alls of the dispatched tokens, and data parallel on the
    attention weights, the layer norms and the gate ``wg`` (experts stay partitioned)."""
    m = MOE
    B, S, H, E = m["batch_size"], m["seq_len"], m["hidden"], m["num_experts"]
    return (4 * all_to_all_cost(mesh, B * S * H * 2 * 4, axis)
            + all_reduce_cost(mesh, H * H * 3 * 4, axis) + all_reduce_cost(mesh, H * 3 * 4, axis)
            + all_reduce_cost(mesh, H * H * 4, axis) + all_reduce_cost(mesh, H * 4, axis)
            + 4 * all_reduce_cost(mesh, H * 4, axis) + all_reduce_cost(mesh, H * E * 4, axis))


@pytest.mark.slow
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_moe_layer_layouts_and_collective_kinds(axis, shape):
    """The assertions of Alpa's test_moe_layer that hold: the attention kernels and the
    gate ``wg`` replicated, the experts ``wi`` / ``wo`` partitioned by expert, 4
    all-to-alls, and every gradient all-reduce in one bucket."""
    plan, _ = _moe_layer_plan(shape)
    layouts = weights(plan)
    for name in ("attention.out.weight", "attention.qkv.weight", "moe.wg"):
        assert all(p == Replicate() for p in layouts[name]), (name, layouts[name])
    for name in ("moe.wi", "moe.wo"):
        assert layouts[name][axis] == Shard(0), (name, layouts[name])
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_reduce"] == 1 and counts["all_to_all"] == 4, counts


@pytest.mark.slow
@pytest.mark.parametrize("axis,shape", [(0, (4, 1)), (1, (1, 4))])
def test_moe_layer(axis, shape):
    """The tokens stay split from attention through the gating: the reshape of (B, S, M)
    into groups (G, S', M) keeps the batch's split as the groups' (passes/rules/view.py,
    a regrouping's common factors), so only the experts' all-to-alls and the gradients
    communicate; our exact figure adds the scalar loss's all-reduce."""
    plan, mesh = _moe_layer_plan(shape)
    expected = _alpa_moe_layer_objective(mesh, axis)
    assert_close(plan.estimates.objective, expected)
    assert plan.estimates.objective == pytest.approx(expected + _loss_all_reduce(mesh, axis))
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["total"] == counts["all_reduce"] + counts["all_to_all"], counts


# Alpa's test_moe_layer_2d options, and the batch on axis 0 that Alpa sets by itself on a
# 2D mesh (its batch filter keeps the mixed split over both axes: ours too)
MOE_2D = dict(allow_mixed_mesh_shape=True, allow_all_gather=False, force_batch_dim_to_mesh_dim=0)


@pytest.mark.slow
def test_moe_layer_2d():
    """Alpa's test_moe_layer_2d, the assertions that hold: mixed mesh shapes allowed, no
    all-gather: some all-to-alls, and nothing but all-to-alls and all-reduces."""
    plan, _ = _moe_layer_plan((2, 2), **MOE_2D)
    counts = communication(plan)
    assert counts["all_to_all"] > 0, counts
    assert counts["total"] == counts["all_reduce"] + counts["all_to_all"], counts


@pytest.mark.slow
def test_moe_layer_2d_all_reduces():
    """Alpa's 2 all-reduces: one for the experts' gradients, one for the others' (our
    loss's 4-byte all-reduces left out: Alpa's step returns no loss). Without the batch
    on axis 0 (Alpa sets it on 2D meshes; the port used to leave it out) the plan split
    the experts over all 4 devices: 863,150 with 9 all-reduces."""
    plan, _ = _moe_layer_plan((2, 2), **MOE_2D)
    assert communication(plan, ignore_scalar_all_reduce=True)["all_reduce"] == 2


@pytest.mark.slow
def test_moe_layer_2d_reduce_scatter():
    """Alpa's test_moe_layer_2d_reduce_scatter (``prefer_reduce_scatter`` on the 2D MoE
    case), the assertions that hold: some all-to-all, some reduce-scatter, nothing but
    all-to-alls, reduce-scatters, all-gathers (the rewrite's, though the ILP may not
    gather) and all-reduces (the objective is the ILP's, 1,444,770)."""
    plan, _ = _moe_layer_plan((2, 2), **MOE_2D, prefer_reduce_scatter=True)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["all_to_all"] > 0 and counts["reduce_scatter"] > 0, counts
    assert counts["total"] == sum(counts[k] for k in ("all_reduce", "reduce_scatter",
                                                      "all_to_all", "all_gather")), counts


@pytest.mark.slow
def test_moe_layer_2d_reduce_scatter_alpa_all_reduces():
    """Alpa's count of all-reduces in test_moe_layer_2d_reduce_scatter: none. The qkv
    bias (split on axis 1) reduce-scatters on axis 0 into its nested strided shard; the
    attention output bias and the norms (split on axis 0) reduce-scatter on axis 1 inside
    their axis-0 pieces, ``(S(0), S(0))``."""
    plan, _ = _moe_layer_plan((2, 2), **MOE_2D, prefer_reduce_scatter=True)
    assert communication(plan, ignore_scalar_all_reduce=True)["all_reduce"] == 0


# -- test_mixed_2d.py -----------------------------------------------------------------------

def test_dot_all_to_all():
    """Alpa's test_dot_all_to_all: mixed mesh shapes allowed, no all-gather, on (2, 2) with
    beta (1, 0.1): some all-to-alls (the regrouped batch meeting the per-expert weights),
    and nothing but all-to-alls and all-reduces."""
    B, M = DotAllToAll.B, DotAllToAll.M
    plan, _ = plan_of(DotAllToAll, (torch.empty(B, M), torch.empty(B, M)), shape=(2, 2),
                      alpha=(1, 1), beta=(1, 0.1), **MOE_2D)
    counts = communication(plan)
    assert counts["all_to_all"] > 0, counts
    assert counts["total"] == counts["all_reduce"] + counts["all_to_all"], counts


# -- test_basic.py --------------------------------------------------------------------------
# Ported: the cases that are training steps. Not portable to a plan of a training step:
# test_donate_buffer, test_dot_reshape_transpose, test_reshape_uneven_partition,
# test_argmax and test_sort parallelize plain functions without a loss or gradients.

@pytest.mark.slow
def test_dropout():
    """Data parallel with the dropout mask drawn per shard (Alpa's HLO draws 1/16 of it per
    device), one all-reduce (the merged gradients; our 4-byte loss all-reduce left out)."""
    x = torch.empty(32, 32, 16)
    plan, _ = plan_of(DenseDropoutDense(), (x, x), shape=(4,), all_reduce_threshold=MERGE_ALL)
    assert plan.estimates.objective < 1e6
    dropout = next(s for s in plan.strategies if s.node == "native_dropout")
    assert dropout.outputs[0] == (Shard(0),), str(dropout)
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["total"] == counts["all_reduce"] == 1, counts


@pytest.mark.slow
def test_gather():
    """The index pick runs on the batch split 4 ways (Alpa: gather of f32[64, 32]), and
    its backward scatter too; one all-reduce."""
    plan, _ = plan_of(DenseGatherDense(), (torch.empty(256, 32), torch.empty(256, 16)),
                      shape=(4,), all_reduce_threshold=MERGE_ALL)
    assert plan.estimates.objective < 1e6
    strategies = {s.node: s for s in plan.strategies}
    assert strategies["index"].inputs[0] == (Shard(0),), str(strategies["index"])
    assert strategies["index_put"].outputs[0] == (Shard(0),), str(strategies["index_put"])
    counts = communication(plan, ignore_scalar_all_reduce=True)
    assert counts["total"] == counts["all_reduce"] == 1, counts


@pytest.mark.slow
def test_gemv():
    """The matrix of a vector-matrix product split by columns (Alpa: f32[128, 64])."""
    plan, _ = plan_of(Gemv(), (torch.empty(128), torch.empty(256)), shape=(4,))
    assert weights(plan)["b"] == (Shard(1),)


def test_one_by_one_mesh():
    """One device: a plan with nothing to communicate."""
    plan, _ = plan_of(Gemv(), (torch.empty(128), torch.empty(256)), shape=(1,))
    assert plan.collectives == () and plan.estimates.objective == 0
    assert weights(plan)["b"] == (Replicate(),)


# -- Alpa's MoE layout on (2, 2), priced by pinning it (issue 14, item 8) ---------------------

def _alpa_moe_2d_layout():
    """Alpa's plan for test_moe_layer_2d as its counts describe it: attention, layer norms
    and the gate replicated (one gradient all-reduce over both axes), the tokens split over
    both axes, the experts over the inner one (their gradients all-reduced over the outer
    one), 4 all-to-alls between."""
    R = Replicate()
    return ((r"attention\..*", (R, R)), (r"norm\..*", (R, R)), (r"moe\.wg", (R, R)),
            (r"moe\.w[io]", (R, Shard(0))), (r"(?!attention|moe|norm).*", (Shard(0), Shard(0))))


@pytest.mark.slow
def test_moe_layer_2d_alpa_layout_and_ours():
    """Alpa's layout, pinned, holds Alpa's counts (2 all-reduces, 4 all-to-alls) once the
    tokens split over both axes reach experts on the inner axis by one all-to-all (it took
    an all-gather, forbidden here, so that layout was infeasible and the ILP settled for
    1,667,741). The ILP's own plan in Alpa's space has the same experts' layout and counts
    and costs less (1,444,770 against 1,454,114)."""
    ours, _ = _moe_layer_plan((2, 2), **MOE_2D)
    alpa, _ = _moe_layer_plan((2, 2), **MOE_2D, pin=_alpa_moe_2d_layout())
    counts = communication(alpa, ignore_scalar_all_reduce=True)
    assert (counts["all_reduce"], counts["all_to_all"], counts["total"]) == (2, 4, 6), counts
    assert ours.estimates.objective <= alpa.estimates.objective
    assert weights(ours)["moe.wi"] == (Replicate(), Shard(0))
    assert communication(ours)["all_gather"] == 0
