"""Spelling invariance: one computation written several ways gets the same plan.

Each case is a computation (a BERT self-attention block, an MLP, a head split, ...) written
the ways users of PyTorch, Flax/Alpa, nanoGPT or timm write it. Every spelling is captured
(``frontends/torch_export.capture``) and planned (``passes/intra_op.plan_intra_op``) on
Alpa's logical meshes with its unit costs (alpha = beta = 1; beta = 0.1 on the second axis
of a 2D mesh), in Alpa's strategy space (no reduce-scatter, one gradient bucket), and
compared with the case's first spelling:

- the ILP objective is the same (up to float rounding);
- the parameters' layouts are the same up to renaming: spellings of one ``family`` hold the
  same parameters in the same order and are compared one by one; across families (a fused
  q/k/v projection against three separate ones) the parameters both hold under the same
  name are compared.

A spelling the planner cannot yet see through stays here as a strict xfail whose reason is
the diagnosis, so it shows as not passing until the rules learn it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchalpa import AutoShardingOption, LogicalMesh, ShardParallel
from torchalpa.frontends.torch_export import capture
from torchalpa.parallel.shard import blocks_of
from torchalpa.passes.sharding.intra_op import plan_intra_op

MESHES = {
    "1d4": LogicalMesh(shape=(4,), alpha=(1.0,), beta=(1.0,)),
    "2d2x2": LogicalMesh(shape=(2, 2), alpha=(1.0, 1.0), beta=(1.0, 0.1)),
}
# Alpa's default space: no reduce-scatter strategies, every gradient in one bucket
METHOD = ShardParallel(auto_sharding_option=AutoShardingOption(
    allow_reduce_scatter=False, all_reduce_threshold=1 << 60))

B, S, H, NH = 4, 8, 32, 4        # batch, sequence, hidden, heads
D = H // NH                      # head dim


def mse(out, y):
    return ((out - y) ** 2).mean()


# -- self-attention: how q, k, v come out of the projection --------------------------------

def _heads(t: torch.Tensor) -> torch.Tensor:
    """(B, S, H) -> (B, nh, S, hd)"""
    return t.reshape(B, S, NH, D).transpose(1, 2)


class Attention(nn.Module):
    """Post-LN BERT self-attention; ``qkv`` names how q, k and v are produced, ``attention``
    how the scores and context are computed. The output projection and norm are named alike
    in every spelling."""

    def __init__(self, qkv: str = "separate", attention: str = "matmul"):
        super().__init__()
        self.qkv_kind, self.attention = qkv, attention
        if qkv == "separate":
            self.query, self.key, self.value = (nn.Linear(H, H) for _ in range(3))
        else:
            self.qkv = nn.Linear(H, 3 * H)
        self.out = nn.Linear(H, H)
        self.norm = nn.LayerNorm(H)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k, v as (B, S, H) each."""
        kind = self.qkv_kind
        if kind == "separate":
            return self.query(x), self.key(x), self.value(x)
        y = self.qkv(x)                                                  # (B, S, 3H)
        if kind == "major_split":                                        # nanoGPT
            return y.split(H, dim=-1)
        if kind == "major_chunk":
            return y.chunk(3, dim=-1)
        if kind == "major_unbind":                                       # timm
            return y.view(B, S, 3, H).unbind(2)
        if kind == "major_index":
            y = y.view(B, S, 3, H)
            return y[:, :, 0], y[:, :, 1], y[:, :, 2]
        y = y.reshape(B, S, H, 3)                                        # (H, 3)-minor
        if kind == "minor_split":                                        # Alpa's Flax BERT
            return tuple(t.reshape(B, S, H) for t in torch.split(y, 1, dim=3))
        if kind == "minor_chunk":
            return tuple(t.squeeze(-1) for t in y.chunk(3, dim=-1))
        if kind == "minor_unbind":
            return y.unbind(-1)
        if kind == "minor_index":
            return y[..., 0], y[..., 1], y[..., 2]
        raise ValueError(kind)

    def context(self, q, k, v, bias):
        """(B, S, H) each -> (B, S, H)"""
        kind, scale = self.attention, D ** -0.5
        if kind == "einsum":                                             # Flax's spelling
            q, k, v = (t.reshape(B, S, NH, D) for t in (q, k, v))
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale + bias
            ctx = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
            return ctx.reshape(B, S, H)
        q, k, v = _heads(q), _heads(k), _heads(v)                        # (B, nh, S, hd)
        if kind == "matmul":
            scores = torch.matmul(q, k.transpose(-1, -2)) * scale + bias
            ctx = torch.matmul(scores.softmax(-1), v)
        elif kind == "bmm":
            q3, k3, v3 = (t.reshape(B * NH, S, D) for t in (q, k, v))
            scores = torch.bmm(q3, k3.transpose(1, 2)).view(B, NH, S, S) * scale + bias
            ctx = torch.bmm(scores.softmax(-1).view(B * NH, S, S), v3).view(B, NH, S, D)
        elif kind == "sdpa":
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            raise ValueError(kind)
        return ctx.transpose(1, 2).reshape(B, S, H)

    def forward(self, x, mask):
        bias = torch.where(mask[:, None, None, :] > 0, 0.0, -1e10)      # (B, 1, 1, S)
        q, k, v = self.project(x)
        return self.norm(self.out(self.context(q, k, v, bias)) + x)


def attention_inputs():
    return (torch.empty(B, S, H), torch.ones(B, S, dtype=torch.int64), torch.empty(B, S, H))


# -- MLP: the same Linear/relu stack as modules, a module list, functional calls ----------

MLP_DIMS = (H, 4 * H, H, 4 * H, H)   # two Megatron blocks: one best plan, no ties


class MLPSequential(nn.Module):
    def __init__(self):
        super().__init__()
        mods: list[nn.Module] = []
        for a, b in zip(MLP_DIMS, MLP_DIMS[1:]):
            mods += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*mods[:-1])

    def forward(self, x):
        return self.net(x)


class MLPModuleList(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(MLP_DIMS, MLP_DIMS[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = F.relu(layer(x))
        return self.layers[-1](x)


class MLPFunctional(nn.Module):
    """Bare parameters and functional calls: ``F.linear``, ``x @ w.T + b``, ``torch.addmm``,
    ``torch.einsum``; ``second`` names the call of the second layer (the first of the row
    split that ends a Megatron block)."""

    def __init__(self, second: str = "linear"):
        super().__init__()
        self.second = second
        shapes = list(zip(MLP_DIMS, MLP_DIMS[1:]))
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(b, a)) for a, b in shapes)
        self.biases = nn.ParameterList(nn.Parameter(torch.randn(b)) for _, b in shapes)

    def forward(self, x):
        w, b = self.weights, self.biases
        x = torch.relu(F.linear(x, w[0], b[0]))
        x = F.linear(x, w[1], b[1]) if self.second == "linear" else x @ w[1].T + b[1]
        x = x.clamp_min(0)
        x = torch.addmm(b[2], x.reshape(-1, x.shape[-1]), w[2].t()).view(B, S, -1).relu()
        return torch.einsum("bsi,oi->bso", x, w[3]) + b[3]

    # named_parameters lists weights then biases; the other spellings interleave them
    def parameter_order(self) -> list[str]:
        return [n for k in range(len(MLP_DIMS) - 1) for n in (f"weights.{k}", f"biases.{k}")]


def mlp_inputs():
    return torch.empty(B, S, H), torch.empty(B, S, H)


# -- head split and merge: view / reshape / flatten / unflatten; permute / transpose ------

class HeadMixer(nn.Module):
    """Project, split the features into heads, scale each head by its own weights, attend
    within each head, merge the heads back and project: ``split`` and ``merge`` name the spelling of the
    reshapes, ``order`` the spelling of the (B, S, nh, hd) <-> (B, nh, S, hd) moves."""

    def __init__(self, split: str = "view", order: str = "transpose"):
        super().__init__()
        self.split, self.order = split, order
        self.proj = nn.Linear(H, H)
        self.mix = nn.Parameter(torch.randn(NH, 1, D))
        self.out = nn.Linear(H, H)

    def _split(self, y):                                                 # (B, S, H)
        if self.split == "view":
            return y.view(B, S, NH, D)
        if self.split == "reshape":
            return y.reshape(B, S, NH, D)
        if self.split == "unflatten":
            return y.unflatten(-1, (NH, D))
        raise ValueError(self.split)

    def _merge(self, y):                                                 # (B, S, nh, hd)
        if self.split == "view":
            return y.contiguous().view(B, S, H)
        if self.split == "reshape":
            return y.reshape(B, S, H)
        return y.flatten(2)

    def _to_heads(self, y):                                              # -> (B, nh, S, hd)
        if self.order == "transpose":
            return y.transpose(1, 2)
        if self.order == "permute":
            return y.permute(0, 2, 1, 3)
        if self.order == "transpose_chain":      # (B,S,nh,hd) -> (B,hd,nh,S) -> (B,nh,hd,S)
            return y.transpose(1, 3).transpose(1, 2).transpose(2, 3)
        raise ValueError(self.order)

    def _from_heads(self, y):                                            # -> (B, S, nh, hd)
        if self.order == "transpose":
            return y.transpose(1, 2)
        if self.order == "permute":
            return y.permute(0, 2, 1, 3)
        return y.transpose(2, 3).transpose(1, 2).transpose(1, 3)

    def forward(self, x):
        h = self._to_heads(self._split(self.proj(x)))                    # (B, nh, S, hd)
        h = h * self.mix                                                 # per-head scale
        h = torch.matmul(torch.matmul(h, h.transpose(-1, -2)).softmax(-1), h)
        return self.out(self._merge(self._from_heads(h)))


# -- the harness ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Spelling:
    case: str
    name: str
    build: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    family: str = ""


def _spellings() -> list[Spelling]:
    out = []
    for qkv in ["separate", "major_split", "major_chunk", "major_unbind", "major_index",
                "minor_split", "minor_chunk", "minor_unbind", "minor_index"]:
        family = qkv.split("_")[0]
        out.append(Spelling("qkv", qkv, functools.partial(Attention, qkv), attention_inputs,
                            family))
    for attention in ["matmul", "einsum", "bmm", "sdpa"]:
        out.append(Spelling("attention", attention,
                            functools.partial(Attention, "separate", attention),
                            attention_inputs))
    out.append(Spelling("attention_fused", "minor_split_einsum",        # the BERT
                        functools.partial(Attention, "minor_split", "einsum"),
                        attention_inputs))
    for name, cls in [("sequential", MLPSequential), ("modulelist", MLPModuleList),
                      ("functional", MLPFunctional),
                      ("functional_matmul_operator",
                       functools.partial(MLPFunctional, "matmul_operator"))]:
        out.append(Spelling("mlp", name, cls, mlp_inputs))
    for split in ["view", "reshape", "unflatten"]:
        out.append(Spelling("heads_reshape", split, functools.partial(HeadMixer, split),
                            mlp_inputs))
    for order in ["transpose", "permute", "transpose_chain"]:
        out.append(Spelling("heads_order", order, functools.partial(HeadMixer, "view", order),
                            mlp_inputs))
    return out


SPELLINGS = _spellings()
REFERENCE = {}
for _s in SPELLINGS:
    REFERENCE.setdefault(_s.case, _s)
# the fused Flax/Alpa BERT block is measured against the same block with separate q, k, v
REFERENCE["attention_fused"] = REFERENCE["qkv"]


@dataclass(frozen=True)
class Planned:
    objective: float
    layouts: tuple[tuple[str, tuple], ...]     # (parameter, placements), in model order


@functools.cache
def _planned(spelling: Spelling, mesh: str) -> Planned:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spelling.build()
        inputs = tuple(t.to("meta") for t in spelling.inputs())
    graph = capture(model, inputs, mse).graph
    plan = plan_intra_op(graph, MESHES[mesh], METHOD, blocks=blocks_of(graph))
    placements = {p.name: tuple(p.placements) for p in plan.parameters}
    order = getattr(model, "parameter_order", None)
    names = order() if order else [n for n, _ in model.named_parameters()]
    return Planned(plan.estimates.objective, tuple((n, placements[n]) for n in names))


# spellings known to lose: (case, spelling, mesh or None for both) -> the diagnosis
TIE = ("not a worse plan: the same objective (7,996.2), but the second bias is (R, S(0)) where "
       "nn.Linear's is (R, R). Not a tie either: this plan's layouts pinned in the nn.Linear "
       "spelling cost 7,996.2 too, but nn.Linear's pinned here cost 8,003.6 (+7.4, an "
       "all-gather of 128 bytes on axis 1): x @ w.T + b adds the bias on (B, S, N), F.linear "
       "on (B * S, N), and the same layouts cost more in this graph (measured 2026-11-28)")
KNOWN_LOSSES: dict[tuple[str, str, str | None], str] = {
    ("mlp", "functional_matmul_operator", "2d2x2"): TIE,
}


def _params():
    out = []
    for s in SPELLINGS:
        if REFERENCE[s.case] is s:
            continue
        for mesh in MESHES:
            why = KNOWN_LOSSES.get((s.case, s.name, mesh)) or \
                KNOWN_LOSSES.get((s.case, s.name, None))
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            out.append(pytest.param(s, mesh, marks=marks, id=f"{s.case}-{s.name}-{mesh}"))
    return out


def _same_layouts(got: Planned, want: Planned, by_position: bool) -> None:
    if by_position:       # the same parameters in the same order, perhaps renamed
        assert [p for _, p in got.layouts] == [p for _, p in want.layouts], \
            f"{got.layouts} vs {want.layouts}"
        return
    theirs = dict(want.layouts)
    common = [(n, p) for n, p in got.layouts if n in theirs]
    assert common, "no parameter to compare by name"
    assert common == [(n, theirs[n]) for n, _ in common]


@pytest.mark.parametrize("spelling,mesh", _params())
def test_spelling_plans_like_the_reference(spelling: Spelling, mesh: str):
    reference = REFERENCE[spelling.case]
    want, got = _planned(reference, mesh), _planned(spelling, mesh)
    assert got.objective == pytest.approx(want.objective, rel=1e-6), \
        f"{spelling.name}: {got.objective:,.0f} vs {reference.name}: {want.objective:,.0f}"
    _same_layouts(got, want, spelling.family == reference.family)
    # within a family (the fused (H, 3)-minor spellings), every parameter alike
    first = next(s for s in SPELLINGS if s.case == spelling.case and s.family == spelling.family)
    if first is not spelling and first is not reference:
        _same_layouts(got, _planned(first, mesh), by_position=True)


# -- the BERT at Alpa's test size: Flax's spelling against separate q, k, v --------

FLAX_2D = ("separate q, k, v lose on 2x2 at this size: 147,995.0 against 145,840.6 for Flax's "
           "spelling and for the zoo's fused (H, 3)-minor unbind, also with nothing simplified "
           "(exact ILP, no shared blocks), so their strategy space lacks a plan the fused one "
           "has; the extra collectives sit on the sum of the three input gradients (an "
           "all-reduce on axis 1) and an all-to-all on the query's backward view; at the "
           "harness's small size all plan 2,402 (re-measured 2026-11-29)")


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [
    "1d4", pytest.param("2d2x2", marks=pytest.mark.xfail(strict=True, reason=FLAX_2D))])
def test_flax_bert_plans_like_separate_projections(mesh):
    """Alpa's ``test_bert_layer_model_parallel`` size (2 layers, B = S = 8, H = 128, 8 heads)
    with Flax's spelling: a fused (H, 3)-minor projection cut by ``torch.split(.., 1, 3)``
    and attention by ``einsum`` (was 540,687 with 8 all-to-alls on 1D 4)."""
    from alpa_cases import BertLayers, bert_inputs

    def objective(qkv: str, attention: str) -> float:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = BertLayers(2, 128, 8, qkv, attention)
            inputs = tuple(t.to("meta") for t in bert_inputs(8, 8, 128))
        graph = capture(model, inputs, mse).graph
        plan = plan_intra_op(graph, MESHES[mesh], METHOD, blocks=blocks_of(graph))
        return plan.estimates.objective

    flax, separate = objective("fused_minor_split", "einsum"), objective("separate", "matmul")
    assert flax == pytest.approx(separate, rel=1e-6), f"{flax:,.1f} vs {separate:,.1f}"


# -- a (3, H)-major spelling's plan run on 4 gloo ranks --------------------------------------

@pytest.mark.slow        # about 24 s (a fresh launch of 4 ranks at load 8)
def test_a_major_fused_qkv_split_over_both_axes_trains_like_one_device(tmp_path):
    """nanoGPT's ``y.split(H, -1)`` of one (3H, H) projection, planned as above on 2x2
    (2,402, as separate q, k, v): the weight and bias stacked strided shards
    ``(S(0)/3, S(0)/3)`` (each rank its quarter of q's, k's and v's rows); two SGD steps
    with momentum on 4 gloo ranks run the plan's collectives and give one device's
    parameters; its checkpoint (DCP) resumes into another plan bit for bit, and a
    safetensors snapshot loads each rank's rows exactly (``tests/spelling_run_worker.py``)."""
    import worker_io
    name = "major_split:2x2"
    r = worker_io.scenario(worker_io.launch("spelling_run_worker.py", tmp_path / "run.json",
                                            name, nproc=4, real=True), name)
    assert r["objective"] == pytest.approx(_planned(REFERENCE["qkv"], "2d2x2").objective,
                                           rel=1e-6)
    stacked = ["S(0)/3", "S(0)/3"]
    assert r["placements"]["qkv.weight"] == r["placements"]["qkv.bias"] == stacked
    assert r["states"]["qkv.weight"] == {"momentum_buffer": stacked}
    assert r["executed"] == r["planned"]
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
    for param, (diff, scale) in r["trained"].items():
        assert diff <= 1e-5 * max(scale, 1.0), (param, diff)
    assert all(diff == 0.0 for diff, _ in r["checkpoint"].values()), r["checkpoint"]
    assert r["checkpoint_next"][0] == r["checkpoint_next"][1]
    assert all(diff == 0.0 for diff, _ in r["pretrained"].values()), r["pretrained"]
