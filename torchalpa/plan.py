"""Plan: everything the runtime needs to execute a parallel training step, as data.

Produced by the planner (on one rank or offline), broadcast as JSON, executed
identically by every rank. It holds the mesh, the placement of every parameter and
input, the strategy (input/output placements) of every op, and every resharding step
between ops with the collective it issues. ``collectives`` is the flat list of what one
training step sends; the runtime issues exactly these (tests count them).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torchalpa.placement import Placements, format_placements, parse_placements, short

__all__ = ["Plan", "ReshardStep", "Reshard", "NodeStrategy", "ValuePlacement", "Collective",
           "PLAN_VERSION", "COLLECTIVE_KINDS"]

PLAN_VERSION = 1
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
STEP_KINDS = COLLECTIVE_KINDS + ("slice",)


@dataclass(frozen=True, slots=True)
class ReshardStep:
    """One move of a tensor from one layout to the next along one mesh axis.

    ``slice`` keeps the local block of a replicated dim (no communication). For the
    others ``bytes`` is what each participating rank contributes.
    """

    kind: str
    axis: int
    bytes: int
    src: Placements
    dst: Placements
    dim: int | None = None        # gathered / scattered / sliced dim; all_to_all: new shard dim
    src_dim: int | None = None    # all_to_all: the dim that was sharded before
    reduce_op: str | None = None  # all_reduce / reduce_scatter: "sum" | "avg"

    @property
    def is_collective(self) -> bool:
        return self.kind != "slice"

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "axis": self.axis, "bytes": self.bytes,
             "src": format_placements(self.src), "dst": format_placements(self.dst)}
        for k in ("dim", "src_dim", "reduce_op"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ReshardStep":
        return cls(kind=d["kind"], axis=d["axis"], bytes=d["bytes"],
                   src=parse_placements(d["src"]), dst=parse_placements(d["dst"]),
                   dim=d.get("dim"), src_dim=d.get("src_dim"), reduce_op=d.get("reduce_op"))


@dataclass(frozen=True, slots=True)
class Reshard:
    """The steps that bring value ``producer[index]`` to the layout ``consumer`` reads.

    ``slot`` is the operand index for an op; for graph outputs the consumer is
    ``"<output>"`` and the slot ``"loss"`` or ``"grad:<parameter>"``; for a user input
    sliced out of the global batch the consumer is the input itself and the slot
    ``"input"``.
    """

    producer: str
    index: int
    consumer: str
    slot: int | str
    steps: tuple[ReshardStep, ...]

    def to_dict(self) -> dict:
        return {"producer": self.producer, "index": self.index, "consumer": self.consumer,
                "slot": self.slot, "steps": [s.to_dict() for s in self.steps]}

    @classmethod
    def from_dict(cls, d: dict) -> "Reshard":
        return cls(producer=d["producer"], index=d["index"], consumer=d["consumer"],
                   slot=d["slot"], steps=tuple(ReshardStep.from_dict(s) for s in d["steps"]))


@dataclass(frozen=True, slots=True)
class NodeStrategy:
    """The layouts one op reads its operands in and writes its results in."""

    node: str
    inputs: tuple[Placements | None, ...]
    outputs: tuple[Placements, ...]

    def to_dict(self) -> dict:
        return {"in": [None if p is None else format_placements(p) for p in self.inputs],
                "out": [format_placements(p) for p in self.outputs]}

    @classmethod
    def from_dict(cls, node: str, d: dict) -> "NodeStrategy":
        return cls(node=node,
                   inputs=tuple(None if p is None else parse_placements(p) for p in d["in"]),
                   outputs=tuple(parse_placements(p) for p in d["out"]))

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

    def to_dict(self) -> dict:
        d = {"kind": self.kind, "axis": self.axis, "bytes": self.bytes, "phase": self.phase,
             "source": self.source, "stage": self.stage, "tensor": self.tensor}
        if self.reduce_op is not None:
            d["reduce_op"] = self.reduce_op
        return d


@dataclass(frozen=True)
class Plan:
    """A complete, executable parallel plan (pure data; JSON round-trip, versioned)."""

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    parameters: tuple[ValuePlacement, ...]
    inputs: tuple[ValuePlacement, ...]
    strategies: tuple[NodeStrategy, ...]
    reshards: tuple[Reshard, ...]
    collectives: tuple[Collective, ...]
    estimates: dict = field(default_factory=dict)
    unsupported_ops: tuple[dict, ...] = ()
    stages: tuple[dict, ...] = ()
    method: dict = field(default_factory=dict)
    graph_fingerprint: str = ""
    notes: tuple[str, ...] = ()
    explanations: dict = field(default_factory=dict)
    """Per parameter: its layout's communication and state, and the runner-up's."""
    version: int = PLAN_VERSION

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
        n = 1
        for s in self.mesh_shape:
            n *= s
        return n

    # -- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": self.version,
            "mesh": {"shape": list(self.mesh_shape), "axis_names": list(self.axis_names)},
            "stages": list(self.stages),
            "parameters": {p.name: p.to_dict() for p in self.parameters},
            "inputs": {p.name: p.to_dict() for p in self.inputs},
            "collectives": [c.to_dict() for c in self.collectives],
            "estimates": dict(self.estimates),
            "unsupported_ops": list(self.unsupported_ops),
            "method": dict(self.method),
            "graph_fingerprint": self.graph_fingerprint,
            "notes": list(self.notes),
            "strategies": {s.node: s.to_dict() for s in self.strategies},
            "reshards": [r.to_dict() for r in self.reshards],
            "explanations": self.explanations,
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        version = d.get("version")
        if version != PLAN_VERSION:
            raise ValueError(f"plan version {version} is not supported (this torchalpa reads "
                             f"version {PLAN_VERSION}); re-plan with this version")

        def values(section):
            return tuple(ValuePlacement(name=k, node=v["node"], shape=tuple(v["shape"]),
                                        placements=parse_placements(v["placements"]))
                         for k, v in section.items())

        return cls(
            mesh_shape=tuple(d["mesh"]["shape"]), axis_names=tuple(d["mesh"]["axis_names"]),
            parameters=values(d["parameters"]), inputs=values(d.get("inputs", {})),
            strategies=tuple(NodeStrategy.from_dict(k, v) for k, v in d["strategies"].items()),
            reshards=tuple(Reshard.from_dict(r) for r in d["reshards"]),
            collectives=tuple(Collective(**c) for c in d["collectives"]),
            estimates=dict(d.get("estimates", {})),
            unsupported_ops=tuple(d.get("unsupported_ops", ())),
            stages=tuple(d.get("stages", ())), method=dict(d.get("method", {})),
            graph_fingerprint=d.get("graph_fingerprint", ""), notes=tuple(d.get("notes", ())),
            explanations=dict(d.get("explanations", {})), version=version)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))

    def save(self, path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path) -> "Plan":
        return cls.from_json(Path(path).read_text())

    # -- reports ------------------------------------------------------------------------
    def collective_counts(self) -> dict[tuple[str, str], int]:
        """(phase, kind) -> count."""
        counts: dict[tuple[str, str], int] = {}
        for c in self.collectives:
            counts[(c.phase, c.kind)] = counts.get((c.phase, c.kind), 0) + 1
        return counts

    def summary(self) -> str:
        from torchalpa.report import plan_summary
        return plan_summary(self)

    def explain(self, name: str) -> str:
        from torchalpa.report import explain
        return explain(self, name)

    def __str__(self) -> str:
        return self.summary()
