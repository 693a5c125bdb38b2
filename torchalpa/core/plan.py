"""Plan: everything the runtime needs to execute a parallel training step, as data.

Produced by the planner (on one rank or offline), broadcast as JSON, executed
identically by every rank. It holds the mesh, the placement of every parameter and
input, the strategy (input/output placements) of every op, and every resharding step
between ops with the collective it issues. ``collectives`` is the flat list of what one
training step sends; the runtime issues exactly these (tests count them).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torchalpa.core.placement import Placements, format_placements, parse_placements, short
from torchalpa.core.plan_records import (
    Estimates,
    Explanation,
    explanations_from_dict,
    explanations_to_dict,
)
from torchalpa.core.view_registry import register_view
from torchalpa.core.view_registry import view as _view

__all__ = ["bucketed_prefix", "BUCKETED_FIRST", "state_read_once",
           "Plan", "ReshardStep", "Reshard", "OutputSlot", "OUTPUT", "INPUT_SLOT", "Slot",
           "MeshStage", "READABLE_PLAN_VERSIONS", "check_version", "NodeStrategy", "ValuePlacement", "Collective",
           "PipelinePlan", "StagePlan", "Transfer", "load_plan", "PLAN_VERSION",
           "COLLECTIVE_KINDS", "PlanError", "read_plan_file", "parse_plan", "register_view"]

SOLVER_EFFORT = frozenset({"time_limit", "max_nodes", "gap", "exact_below",
                           "free_followers_below", "free_followers_near_budget",
                           "alternate_blocks"})
"""``AutoShardingOption`` fields that decide how long the ILP works on a plan, not which
layouts it may choose."""

PLAN_VERSION = 2
READABLE_PLAN_VERSIONS = (1, 2)
"""Version 2 writes output slots and stages as typed records; version-1 files (slot
strings such as ``"grad:<parameter>"``) are still read, into the same records."""
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
STEP_KINDS = COLLECTIVE_KINDS + ("slice", "partition")


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """One move of a tensor from one layout to the next along one mesh axis.

    ``slice`` keeps the local block of a replicated dim, ``partition`` turns a replicated
    value into a partial sum (kept at coordinate 0, zeros elsewhere): no communication.
    For the others ``bytes`` is what each participating rank contributes.
    """

    kind: str
    axis: int
    bytes: int
    src: Placements
    dst: Placements
    dim: int | None = None        # gathered / scattered / sliced dim; all_to_all: new shard dim
    src_dim: int | None = None    # all_to_all: the dim that was sharded before
    reduce_op: str | None = None  # all_reduce / reduce_scatter: "sum" | "avg" | "max" | "min"

    @property
    def is_collective(self) -> bool:
        return self.kind not in ("slice", "partition")

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "axis": self.axis, "bytes": self.bytes,
             "src": format_placements(self.src), "dst": format_placements(self.dst)}
        for k in ("dim", "src_dim", "reduce_op"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ReshardStep:
        return cls(kind=d["kind"], axis=d["axis"], bytes=d["bytes"],
                   src=parse_placements(d["src"]), dst=parse_placements(d["dst"]),
                   dim=d.get("dim"), src_dim=d.get("src_dim"), reduce_op=d.get("reduce_op"))


BUCKETED_FIRST = ("all_reduce", "reduce_scatter")
"""The step kinds that may start a gradient's bucketed reduction."""


def bucketed_prefix(steps, mesh_shape) -> int:
    """How many leading steps of a gradient's final resharding travel in a gradient bucket
    (``runtime/rewrites/buckets.py``; ``passes/pricing/cost.py`` prices them so): a first all-reduce or
    reduce-scatter over an axis of more than one device, then each all-reduce that follows
    over another such axis. A bucket's buffer goes through them all, one collective per
    step for the whole bucket: on a 2-D mesh, a gradient summed over both axes is two
    bucketed all-reduces, not one per gradient on the second axis. Reduction is
    elementwise, so reducing the packed buffer twice equals reducing each gradient twice.
    0: the first step is neither (the gradient is not bucketed)."""
    if not steps or steps[0].kind not in BUCKETED_FIRST or mesh_shape[steps[0].axis] <= 1:
        return 0
    axes = {steps[0].axis}
    count = 1
    for step in steps[1:]:
        if step.kind != "all_reduce" or mesh_shape[step.axis] <= 1 or step.axis in axes:
            break
        axes.add(step.axis)
        count += 1
    return count


def state_read_once(num_micro_batches: int, rematerialize_parameters: bool) -> bool:
    """Whether a step reshards each forward read of a parameter or buffer once, before its
    first micro-batch, instead of once per micro-batch (``runtime/rewrites/param_gather.py``; the
    cost model prices such a read once, ``passes/sharding/costgraph.py``, ``passes/sharding/intra_op.py``):
    with gradient accumulation, unless the method gathers parameters again in backward to
    hold less (ZeRO-3's ``rematerialize_parameters``), whose gathers stay per micro-batch.
    The copy lives for the step (until the last backward that reads it)."""
    return num_micro_batches > 1 and not rematerialize_parameters


OUTPUT = "<output>"
"""The consumer of a reshard that lays out a value the step returns or sends."""

OUTPUT_SLOT_KINDS = ("loss", "grad", "buffer", "send")


@dataclass(frozen=True, slots=True)
class OutputSlot:
    """What the step does with a value it hands out: the ``loss``, the gradient of the
    parameter ``name`` (``grad``), the new value of the buffer ``name`` (``buffer``), or
    the value ``name`` (a ``ValueRef`` string) sent to another pipeline stage (``send``)."""

    kind: str
    name: str = ""

    def __post_init__(self):
        if self.kind not in OUTPUT_SLOT_KINDS:
            raise ValueError(f"output slot kind {self.kind!r} is none of {OUTPUT_SLOT_KINDS}")
        if (self.kind == "loss") != (self.name == ""):
            raise ValueError(f"output slot {self.kind!r}: the loss has no name, every other "
                             f"slot names its parameter, buffer or value (got {self.name!r})")

    @classmethod
    def loss(cls) -> OutputSlot:
        return cls("loss")

    @classmethod
    def grad(cls, fqn: str) -> OutputSlot:
        return cls("grad", fqn)

    @classmethod
    def buffer(cls, fqn: str) -> OutputSlot:
        return cls("buffer", fqn)

    @classmethod
    def send(cls, ref: str) -> OutputSlot:
        return cls("send", ref)

    def reshard_key(self) -> tuple[str, OutputSlot]:
        """The (consumer, slot) under which ``Plan.reshards`` holds this slot's steps."""
        return (OUTPUT, self)

    def __str__(self) -> str:
        return self.kind if self.kind == "loss" else f"{self.kind}:{self.name}"

    @classmethod
    def parse(cls, text: str) -> OutputSlot:
        """Read ``str(slot)`` back (the slot strings of version-1 plans)."""
        kind, _, name = text.partition(":")
        return cls(kind, name)


INPUT_SLOT = "input"
"""The slot of a user input's own reshard (sliced out of the global batch)."""

Slot = int | str | OutputSlot
"""Where a reshard delivers: an op's operand index, ``INPUT_SLOT``, or an ``OutputSlot``."""


def slot_to_json(slot: Slot) -> int | str | dict:
    """The one place a reshard slot is written: operand indices and ``"input"`` as they
    are, an output slot as ``{"output": kind, "name": name}``."""
    if isinstance(slot, OutputSlot):
        return {"output": slot.kind, "name": slot.name}
    return slot


def slot_from_json(consumer: str, value, version: int) -> Slot:
    """Read a slot written by ``slot_to_json`` (or a version-1 slot string)."""
    if isinstance(value, dict):
        return OutputSlot(value["output"], value.get("name", ""))
    if version == 1 and consumer == OUTPUT and isinstance(value, str):
        return OutputSlot.parse(value)
    if isinstance(value, int) or value == INPUT_SLOT:
        return value
    raise ValueError(f"reshard slot {value!r} of consumer {consumer!r} is neither an operand "
                     f"index, {INPUT_SLOT!r} nor an output slot")


@dataclass(frozen=True, slots=True)
class Reshard:
    """The steps that bring value ``producer[index]`` to the layout ``consumer`` reads.

    ``slot`` is the operand index for an op; for what the step hands out the consumer is
    ``OUTPUT`` and the slot an ``OutputSlot`` (the loss, a parameter's gradient, a
    buffer's new value, a value sent to another stage); for a user input sliced out of
    the global batch the consumer is the input itself and the slot ``INPUT_SLOT``.

    ``same_as``: another operand read (consumer, slot), earlier in the step, that reshards
    this value with the same steps; this read takes that resharded copy and has no steps
    of its own (one collective, however many ops read the result: XLA's CSE).
    """

    producer: str
    index: int
    consumer: str
    slot: Slot
    steps: tuple[ReshardStep, ...]
    same_as: tuple[str, int] | None = None

    def to_dict(self) -> dict:
        d = {"producer": self.producer, "index": self.index, "consumer": self.consumer,
             "slot": slot_to_json(self.slot), "steps": [s.to_dict() for s in self.steps]}
        if self.same_as is not None:
            d["same_as"] = list(self.same_as)
        return d

    @classmethod
    def from_dict(cls, d: dict, version: int = PLAN_VERSION) -> Reshard:
        same_as = d.get("same_as")
        return cls(producer=d["producer"], index=d["index"], consumer=d["consumer"],
                   slot=slot_from_json(d["consumer"], d["slot"], version),
                   steps=tuple(ReshardStep.from_dict(s) for s in d["steps"]),
                   same_as=None if same_as is None else (same_as[0], int(same_as[1])))


@dataclass(frozen=True, slots=True)
class NodeStrategy:
    """The layouts one op reads its operands in and writes its results in."""

    node: str
    inputs: tuple[Placements | None, ...]
    outputs: tuple[Placements, ...]
    batch_syncs: tuple[tuple[int, int], ...] = ()
    """(mesh axis, bytes): sum all-reduces a batch-synced op runs inside itself
    (synchronized batch norm over a split batch); each is also listed in the plan's
    ``collectives``. A phased softmax's all-reduces are not recorded here: the runtime
    derives them from the op's input placements (``runtime/lowering/synced.py``)."""

    def to_dict(self) -> dict:
        d = {"in": [None if p is None else format_placements(p) for p in self.inputs],
             "out": [format_placements(p) for p in self.outputs]}
        if self.batch_syncs:
            d["batch_syncs"] = [list(s) for s in self.batch_syncs]
        return d

    @classmethod
    def from_dict(cls, node: str, d: dict) -> NodeStrategy:
        return cls(node=node,
                   inputs=tuple(None if p is None else parse_placements(p) for p in d["in"]),
                   outputs=tuple(parse_placements(p) for p in d["out"]),
                   batch_syncs=tuple((int(a), int(b))
                                     for a, b in d.get("batch_syncs", ())))

    def __str__(self) -> str:
        ins = ", ".join("*" if p is None else short(p) for p in self.inputs)
        return f"({ins}) -> {', '.join(short(p) for p in self.outputs)}"


@dataclass(frozen=True, slots=True)
class ValuePlacement:
    """Where a parameter or user input lives: its global shape and placements."""

    name: str
    node: str
    shape: tuple[int, ...]
    placements: Placements

    def to_dict(self) -> dict:
        return {"node": self.node, "shape": list(self.shape),
                "placements": format_placements(self.placements)}


@dataclass(frozen=True, slots=True)
class Collective:
    """One collective a training step issues (the plan's prediction of it)."""

    kind: str
    axis: int
    bytes: int
    phase: str
    source: str       # module path the user wrote ("" for the top level)
    tensor: str       # the value being moved (graph node name)
    stage: int = 0
    reduce_op: str | None = None
    stack: str = ""   # "file:line" of the op it serves, where the capture knows it

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "axis": self.axis, "bytes": self.bytes, "phase": self.phase,
             "source": self.source, "stage": self.stage, "tensor": self.tensor}
        if self.reduce_op is not None:
            d["reduce_op"] = self.reduce_op
        if self.stack:
            d["stack"] = self.stack
        return d


@dataclass(frozen=True, slots=True)
class MeshStage:
    """The one stage of an intra-op plan: its layers and the mesh it runs on (a pipeline
    plan's stages are ``StagePlan``s)."""

    layers: tuple[int, ...]
    logical_shape: tuple[int, ...]
    num_devices: int

    def to_dict(self) -> dict:
        return {"layers": list(self.layers), "logical_shape": list(self.logical_shape),
                "num_devices": self.num_devices}

    @classmethod
    def from_dict(cls, d: dict) -> MeshStage:
        return cls(layers=tuple(d["layers"]), logical_shape=tuple(d["logical_shape"]),
                   num_devices=int(d["num_devices"]))


def check_version(version) -> int:
    """``version`` if this torchalpa reads plans of it, else a ValueError saying so."""
    if version not in READABLE_PLAN_VERSIONS:
        raise ValueError(f"plan version {version} is not supported (this torchalpa reads "
                         f"versions {', '.join(map(str, READABLE_PLAN_VERSIONS))}); re-plan "
                         "with this version")
    return version


class _PlanViews:
    """The views both kinds of plan have, read by the same registered functions."""

    def explain_choice(self) -> str:
        """AutoParallel's choice: every candidate it tried and what became of it."""
        return _view("explain_choice")(self)

    def to_html(self, path) -> None:
        """Write one self-contained HTML page picturing the plan (``torchalpa.views.pictures``)."""
        Path(path).write_text(_view("html")(self), encoding="utf-8")

    def to_chrome_trace(self, path) -> None:
        """Write the estimated step as a Chrome / Perfetto trace (JSON)."""
        _view("chrome_trace")(self, path)


@dataclass(frozen=True)
class Plan(_PlanViews):
    """A complete, executable parallel plan (pure data; JSON round-trip, versioned)."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    parameters: tuple[ValuePlacement, ...]
    inputs: tuple[ValuePlacement, ...]
    strategies: tuple[NodeStrategy, ...]
    reshards: tuple[Reshard, ...]
    collectives: tuple[Collective, ...]
    estimates: Estimates = field(default_factory=Estimates)
    """The planner's predictions (a dict given here becomes the record)."""
    unsupported_ops: tuple[dict, ...] = ()
    stages: tuple[MeshStage, ...] = ()
    method: dict = field(default_factory=dict)
    graph_fingerprint: str = ""
    notes: tuple[str, ...] = ()
    explanations: dict[str, Explanation] = field(default_factory=dict)
    """Per parameter: its layout's communication and state, and the runner-up's."""
    version: int = PLAN_VERSION
    mode: str = "training"
    """What the step is: "training" (forward, backward, optimizer) or "inference" (the
    decode step of generation: ``torchalpa.Inference``)."""

    def __post_init__(self):
        # records however they were given (dicts from passes, tests or older code)
        object.__setattr__(self, "estimates", Estimates.from_dict(self.estimates))
        object.__setattr__(self, "explanations", explanations_from_dict(self.explanations))

    # -- lookups ------------------------------------------------------------------------
    def strategy(self, node: str) -> NodeStrategy:
        return self._strategy_index()[node]

    def _strategy_index(self) -> dict[str, NodeStrategy]:
        return {s.node: s for s in self.strategies}

    def parameter(self, name: str) -> ValuePlacement:
        for p in self.parameters:
            if p.name == name:
                return p
        raise KeyError(f"no parameter {name!r} in the plan; parameters: "
                       f"{', '.join(p.name for p in self.parameters[:8])}...")

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape)

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "mode": self.mode,
            "mesh": {"shape": list(self.mesh_shape), "axis_names": list(self.axis_names)},
            "stages": [s.to_dict() for s in self.stages],
            "parameters": {p.name: p.to_dict() for p in self.parameters},
            "inputs": {p.name: p.to_dict() for p in self.inputs},
            "collectives": [c.to_dict() for c in self.collectives],
            "estimates": self.estimates.to_dict(),
            "unsupported_ops": list(self.unsupported_ops),
            "method": dict(self.method),
            "graph_fingerprint": self.graph_fingerprint,
            "notes": list(self.notes),
            "strategies": {s.node: s.to_dict() for s in self.strategies},
            "reshards": [r.to_dict() for r in self.reshards],
            "explanations": explanations_to_dict(self.explanations),
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        version = check_version(d.get("version"))

        def values(section):
            return tuple(ValuePlacement(name=k, node=v["node"], shape=tuple(v["shape"]),
                                        placements=parse_placements(v["placements"]))
                         for k, v in section.items())

        return cls(
            mesh_shape=tuple(d["mesh"]["shape"]), axis_names=tuple(d["mesh"]["axis_names"]),
            parameters=values(d["parameters"]), inputs=values(d.get("inputs", {})),
            strategies=tuple(NodeStrategy.from_dict(k, v) for k, v in d["strategies"].items()),
            reshards=tuple(Reshard.from_dict(r, version) for r in d["reshards"]),
            collectives=tuple(Collective(**c) for c in d["collectives"]),
            estimates=Estimates.from_dict(d.get("estimates")),
            unsupported_ops=tuple(d.get("unsupported_ops", ())),
            stages=tuple(MeshStage.from_dict(s) for s in d.get("stages", ())),
            method=dict(d.get("method", {})),
            graph_fingerprint=d.get("graph_fingerprint", ""), notes=tuple(d.get("notes", ())),
            explanations=explanations_from_dict(d.get("explanations")),
            mode=d.get("mode", "training"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def save(self, path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path) -> Plan:
        plan = load_plan(Path(path))
        if not isinstance(plan, cls):
            raise ValueError(f"{path} holds a {type(plan).__name__}, not a {cls.__name__}")
        return plan

    # -- reports ------------------------------------------------------------------------
    def summary(self, *, detail: str = "short", filter: str | None = None) -> str:
        """One screen: repeated layers folded, communication by module, the ten costliest
        collectives. ``detail="full"`` lists every row; ``filter`` is a glob over
        parameter names and module paths (``"layers.0.*"``)."""
        return _view("summary")(self, detail=detail, filter=filter)

    def explain(self, name: str) -> str:
        return _view("explain")(self, name)

    def to_tp_plan(self, model=None, *, axis: int | str | None = None) -> dict:
        """The plan as torch's ``parallelize_module`` plan ``{module: ColwiseParallel() |
        RowwiseParallel()}`` for mesh axis ``axis``, where the plan is expressible that
        way; ``NotExpressibleError`` naming the layer otherwise (``torchalpa.interop.tp_plan``)."""
        return _view("tp_plan")(self, model, axis)

    def __str__(self) -> str:
        return self.summary()


@dataclass(frozen=True, slots=True)
class Transfer:
    """A value one stage makes and another reads: sent point to point every micro-batch,
    or once per step (``once_per_step``) when that gives the same result: a parameter (a
    tied weight read by a later stage does not change between micro-batches), or a
    gradient contribution the receiver only adds into a parameter's gradient (the sender
    sums it over the micro-batches and sends the sum).

    The sender holds it whole (its stage plan gathers it); each receiving rank takes the
    block its own stage plan reads. ``bytes`` is the whole tensor. ``batch_split`` > 1:
    the value crosses with its batch (dim 0) split over the first axis of both stages'
    meshes (the same logical shape; ``boundary_layout``), as each data-parallel replica
    computed it: the rank at a position of the sending stage's mesh sends its own block
    to the rank at the same position of the receiving stage's, and neither gathers over
    that axis (Megatron sends each replica's slice). ``split`` > 1 (Megatron's
    scatter-gather): each receiving rank is sent only chunk ``c`` of ``split`` of the
    flattened value (of its block, when batch-split), ``c`` its coordinate on its stage
    mesh's last axis (of ``split`` ranks), and the receivers all-gather the chunks over
    that axis.
    """

    producer: str
    index: int
    src_stage: int
    dst_stage: int
    phase: str          # forward (activations) or backward (gradients)
    bytes: int
    once_per_step: bool = False
    split: int = 1
    batch_split: int = 1

    def bytes_per_receiver(self) -> int:
        """Bytes each receiving rank is sent (one micro-batch, or the step's one message)."""
        return self.bytes // (self.split * self.batch_split)

    def to_dict(self) -> dict:
        return {"producer": self.producer, "index": self.index, "src_stage": self.src_stage,
                "dst_stage": self.dst_stage, "phase": self.phase, "bytes": self.bytes,
                "once_per_step": self.once_per_step, "split": self.split,
                "batch_split": self.batch_split}


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: its layers, its submesh of the cluster and its intra-op plan."""

    index: int
    layers: tuple[int, ...]
    submesh: tuple[int, int]          # physical (nodes, devices per node)
    ranks: tuple[int, ...]            # global ranks, row-major over the logical shape
    plan: Plan                        # the stage's own intra-op plan (its mesh = logical shape)
    # activation checkpointing of the whole stage: each micro-batch keeps only its inputs
    # from forward, and its forward runs again right before its backward
    # (``passes/pipeline_search/stage_recompute.py`` prices it, ``runtime/execution/step.StepRunner`` runs it)
    recompute: bool = False

    def to_dict(self) -> dict:
        d: dict = {"layers": list(self.layers), "submesh": list(self.submesh),
                   "logical_shape": list(self.plan.mesh_shape), "ranks": list(self.ranks)}
        if self.recompute:
            d["recompute"] = True
        d["plan"] = self.plan.to_dict()
        return d

    @classmethod
    def from_dict(cls, index: int, d: dict) -> StagePlan:
        return cls(index=index, layers=tuple(d["layers"]), submesh=tuple(d["submesh"]),
                   ranks=tuple(d["ranks"]), plan=Plan.from_dict(d["plan"]),
                   recompute=bool(d.get("recompute", False)))


@dataclass(frozen=True)
class PipelinePlan(_PlanViews):
    """Alpa's pipeshard plan: stages on submeshes, each sharded by its own intra-op plan."""

    mesh_shape: tuple[int, ...]          # the cluster: (nodes, devices per node)
    stages: tuple[StagePlan, ...]
    transfers: tuple[Transfer, ...]
    node_stage: dict                      # graph node -> stage index
    num_micro_batches: int
    schedule: str
    estimates: Estimates = field(default_factory=Estimates)
    method: dict = field(default_factory=dict)
    graph_fingerprint: str = ""
    notes: tuple[str, ...] = ()
    version: int = PLAN_VERSION

    def __post_init__(self):
        object.__setattr__(self, "estimates", Estimates.from_dict(self.estimates))
        for t in self.transfers:
            # per micro-batch, activations go to later stages and gradients to earlier ones;
            # anything else waits on a stage that has not run yet, under every schedule
            against = t.dst_stage <= t.src_stage if t.phase == "forward" else \
                t.dst_stage >= t.src_stage
            if against and not t.once_per_step:
                raise PlanError(
                    f"this pipeline plan sends {t.producer!r} from stage {t.src_stage} to stage "
                    f"{t.dst_stage} in {t.phase} every micro-batch: the receiver would wait "
                    "for a stage that runs after it, so no schedule can run the plan; it is "
                    "a planner error -- plan again, or cut the stages elsewhere "
                    "(ManualStageOption)")

    @property
    def forward_stage_layer_ids(self) -> list[list[int]]:
        return [list(s.layers) for s in self.stages]

    @property
    def submesh_shapes(self) -> list[tuple[int, int]]:
        return [s.submesh for s in self.stages]

    @property
    def logical_shapes(self) -> list[tuple[int, ...]]:
        return [s.plan.mesh_shape for s in self.stages]

    @property
    def stage_options(self) -> list[dict]:
        """Each stage's intra-op options where they differ from the defaults (Alpa's
        per-stage autosharding options), e.g. ``{"parameters": "sharded"}``. How hard its
        ILP was worked (``SOLVER_EFFORT``: the pipeline search caps the re-solves of the
        stages it prices) is left out: it shapes no layout a user could ask for; each
        stage's ``plan.method`` still records it."""
        from torchalpa.core.options import AutoShardingOption
        default = json.loads(json.dumps(asdict(AutoShardingOption())))
        out = []
        for s in self.stages:
            given = s.plan.method.get("auto_sharding_option", {})
            out.append({k: v for k, v in given.items()
                        if default.get(k) != v and k not in SOLVER_EFFORT})
        return out

    @property
    def num_devices(self) -> int:
        return math.prod(self.mesh_shape)

    @property
    def parameters(self) -> tuple[ValuePlacement, ...]:
        return tuple(p for s in self.stages for p in s.plan.parameters)

    @property
    def collectives(self) -> tuple[Collective, ...]:
        """Every stage's collectives (one micro-batch each), tagged with the stage."""
        from dataclasses import replace
        return tuple(replace(c, stage=s.index) for s in self.stages for c in s.plan.collectives)

    def stage_of_rank(self, rank: int) -> StagePlan:
        for s in self.stages:
            if rank in s.ranks:
                return s
        raise ValueError(f"rank {rank} is in no stage of this plan")

    def to_dict(self) -> dict:
        return {
            "version": self.version, "kind": "pipeline",
            "mesh": {"shape": list(self.mesh_shape), "axis_names": ["node", "device"]},
            "stages": [s.to_dict() for s in self.stages],
            "forward_stage_layer_ids": self.forward_stage_layer_ids,
            "submesh_shapes": [list(s) for s in self.submesh_shapes],
            "logical_shapes": [list(s) for s in self.logical_shapes],
            "stage_options": self.stage_options,
            "parameters": {p.name: dict(p.to_dict(), stage=s.index)
                           for s in self.stages for p in s.plan.parameters},
            "collectives": [dict(c.to_dict(), stage=s.index)
                            for s in self.stages for c in s.plan.collectives]
                           + [dict(kind="send_recv", axis=None, bytes=t.bytes, phase=t.phase,
                                   source="", stage=t.src_stage, tensor=t.producer,
                                   dst_stage=t.dst_stage) for t in self.transfers],
            "transfers": [t.to_dict() for t in self.transfers],
            "node_stage": dict(self.node_stage),
            "num_micro_batches": self.num_micro_batches, "schedule": self.schedule,
            "estimates": self.estimates.to_dict(), "method": dict(self.method),
            "graph_fingerprint": self.graph_fingerprint, "notes": list(self.notes),
            "unsupported_ops": [u for s in self.stages for u in s.plan.unsupported_ops],
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> PipelinePlan:
        check_version(d.get("version"))
        return cls(mesh_shape=tuple(d["mesh"]["shape"]),
                   stages=tuple(StagePlan.from_dict(i, s) for i, s in enumerate(d["stages"])),
                   transfers=tuple(Transfer(**t) for t in d["transfers"]),
                   node_stage=dict(d["node_stage"]), num_micro_batches=d["num_micro_batches"],
                   schedule=d["schedule"], estimates=Estimates.from_dict(d.get("estimates")),
                   method=dict(d.get("method", {})),
                   graph_fingerprint=d.get("graph_fingerprint", ""),
                   notes=tuple(d.get("notes", ())))   # read into this version's records

    @classmethod
    def from_json(cls, text: str) -> PipelinePlan:
        return cls.from_dict(json.loads(text))

    def save(self, path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path) -> PipelinePlan:
        plan = load_plan(Path(path))
        if not isinstance(plan, cls):
            raise ValueError(f"{path} holds a {type(plan).__name__}, not a {cls.__name__}")
        return plan

    def summary(self, *, detail: str = "short", filter: str | None = None) -> str:
        """The stages, transfers and timeline; ``detail="full"`` (or a ``filter``) adds
        each stage's own plan summary."""
        text = _view("pipeline_summary")(self, detail)
        if detail != "short" or filter is not None:
            for s in self.stages:
                text += f"\n\nstage {s.index}:\n" + s.plan.summary(detail=detail, filter=filter)
        return text

    def explain(self, name: str) -> str:
        return _view("pipeline_explain")(self, name)

    def __str__(self) -> str:
        return self.summary()


def load_plan(path_or_text: str | Path) -> Plan | PipelinePlan:
    """A plan of either kind from a file path or JSON text; a ``PlanError`` (a
    ValueError) naming the file for anything that is not a readable plan."""
    if isinstance(path_or_text, Path) or not str(path_or_text).lstrip().startswith("{"):
        return read_plan_file(path_or_text)
    return parse_plan(str(path_or_text), "the plan JSON text")


class PlanError(ValueError):
    """A plan that cannot be used here; the message names where it came from."""


def read_plan_file(path: str | Path) -> Plan | PipelinePlan:
    """The plan in the JSON file ``path``; ``PlanError`` naming the file if it is not one."""
    path = Path(path)
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PlanError(f"cannot read the plan file {path}: {e}") from e
    return parse_plan(text, str(path))


def parse_plan(text: str, source: str) -> Plan | PipelinePlan:
    """The plan in JSON ``text`` read from ``source`` (a path, or a description)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlanError(f"{source} is not valid JSON ({e}); it is truncated or not a plan "
                        "file -- plan again (torchalpa.plan(...).save(path))") from e
    if not isinstance(data, dict):
        raise PlanError(f"{source} holds a JSON {type(data).__name__}, not a plan object")
    if data.get("version") not in READABLE_PLAN_VERSIONS:
        raise PlanError(f"{source} is a plan of version {data.get('version')!r}; this torchalpa "
                        f"reads versions {', '.join(map(str, READABLE_PLAN_VERSIONS))} -- plan "
                        "again with this version")
    try:
        if data.get("kind") == "pipeline":
            return PipelinePlan.from_dict(data)
        return Plan.from_dict(data)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
        raise PlanError(f"{source} is not a valid plan ({type(e).__name__}: {e}); it was "
                        "edited or damaged -- plan again") from e
