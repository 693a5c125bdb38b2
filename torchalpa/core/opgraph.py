"""OpGraph: the training step as a graph of tensor ops, the one IR every pass reads.

A frontend (``frontends/``) turns a model + loss into an OpGraph; passes read it and
produce data (strategies, a Plan); nothing else constructs ops. Nodes are frozen
``OpNode`` values in capture (topological) order, held in a ``networkx.DiGraph`` whose
edges run producer -> consumer and record which operand slots the value feeds.

Leaves are parameters, buffers and user inputs (``kind``); every other node is an op.
Non-tensor arguments are kept (``args``/``kwargs``) with tensor arguments replaced by
``Operand(k)`` markers, so rules can read dims, sizes and flags without torch.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import networkx as nx

__all__ = ["TensorSpec", "ValueRef", "Operand", "OpNode", "OpGraph", "GraphError", "DTYPE_BYTES",
           "ABSENT_DTYPE", "block_of"]

LEAF_KINDS = ("param", "buffer", "input")


def block_of(module_path: str) -> tuple[str, int] | None:
    """(container path, index) of the outermost numbered component of a module path
    (``layers.3.attn`` -> ``("layers", 3)``), or None: the repeated block an op is in."""
    parts = module_path.split(".")
    for i in range(1, len(parts)):
        if parts[i].isdigit():
            return ".".join(parts[:i]), int(parts[i])
    return None
PHASES = ("forward", "backward")

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
    "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16, "none": 0,
}
ABSENT_DTYPE = "none"   # TensorSpec dtype of an output an op did not produce (None)


class GraphError(ValueError):
    """An OpGraph that breaks the IR's invariants; the message shows the node."""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Global shape and dtype of one tensor value."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES.get(self.dtype, 4)

    @property
    def nbytes(self) -> int:
        # numel * itemsize, inline: planning asks it hundreds of thousands of times
        return math.prod(self.shape) * DTYPE_BYTES.get(self.dtype, 4)

    @property
    def is_absent(self) -> bool:
        """A placeholder for a ``None`` output (a backward op's ``output_mask`` said False):
        outputs stay positional, so ``outputs[i]`` is ``getitem(op, i)``; it holds no bytes."""
        return self.dtype == ABSENT_DTYPE

    def __str__(self) -> str:
        return "none" if self.is_absent else f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True, slots=True)
class ValueRef:
    """Output ``index`` of node ``node``."""

    node: str
    index: int = 0

    def __str__(self) -> str:
        return self.node if self.index == 0 else f"{self.node}[{self.index}]"


@dataclass(frozen=True, slots=True)
class Operand:
    """Placeholder for the k-th tensor operand inside an op's ``args``."""

    k: int

    def __repr__(self) -> str:
        return f"%{self.k}"


@dataclass(frozen=True, slots=True)
class OpNode:
    """One tensor op (or a leaf: parameter, buffer, input) of the training step."""

    name: str
    op: str
    kind: str = "op"
    operands: tuple[ValueRef, ...] = ()
    args: tuple = ()
    kwargs: tuple = ()          # sorted (key, value) pairs
    outputs: tuple[TensorSpec, ...] = ()
    flops: float = 0.0
    bytes: float = 0.0
    module: str = ""            # module path the user wrote, e.g. "layers.3.mlp.down_proj"
    phase: str = "forward"
    source: str = ""            # the fx node name (torch) or op location (StableHLO)
    stack: str = ""             # "file:line" of the user code that created it, if known
    target: str | None = None   # FQN of the parameter/buffer, or the user input's name
    is_param: bool = False
    is_grad: bool = False
    is_optimizer_state: bool = False
    aliases: bool = False
    """The results are views of operand 0's storage (``view``, ``permute``, ``expand``...):
    they hold no bytes of their own and move none, and keep that storage alive."""
    layer: int | None = None
    stage: int | None = None
    batched: bool = True
    """For a user input (kind ``input``): whether its dim 0 is the batch. A value a
    pipeline stage receives from another that derives from parameters alone (a tied
    weight, or its cast to the compute dtype) is an input of the stage's graph without
    a batch."""

    @property
    def is_leaf(self) -> bool:
        return self.kind in LEAF_KINDS

    @property
    def output(self) -> TensorSpec:
        return self.outputs[0]

    @property
    def kwarg_dict(self) -> dict[str, Any]:
        return dict(self.kwargs)

    def where(self) -> str:
        """How error messages point at this node: op, module path and source line."""
        parts = [f"{self.name} ({self.op})"]
        if self.module:
            parts.append(f"in module '{self.module}'")
        if self.stack:
            parts.append(f"at {self.stack}")
        return " ".join(parts)


@dataclass(frozen=True)
class GraphOutputs:
    """What the training step returns: the loss, each trainable parameter's gradient, and
    the new value of each buffer the forward writes (batch-norm running statistics).

    A pipeline stage's graph may have no loss (only the last stage computes it) and
    ``sends``: values other stages read, which it must produce whole."""

    loss: ValueRef | None
    grads: tuple[tuple[str, ValueRef], ...] = ()   # (parameter FQN, gradient value)
    buffer_updates: tuple[tuple[str, ValueRef], ...] = ()   # (buffer FQN, its new value)
    sends: tuple[ValueRef, ...] = ()

    def refs(self) -> list[ValueRef]:
        """Every value the graph hands out."""
        return ([self.loss] if self.loss is not None else []) + [r for _, r in self.grads] + \
            [r for _, r in self.buffer_updates] + list(self.sends)


class OpGraph:
    """Ops of one training step in topological order, over a networkx DiGraph."""

    def __init__(self, nodes: list[OpNode], outputs: GraphOutputs, meta: dict | None = None):
        self._nodes: dict[str, OpNode] = {}
        self.nx = nx.DiGraph()
        for node in nodes:
            if node.name in self._nodes:
                raise GraphError(f"duplicate node name {node.name!r}")
            self._nodes[node.name] = node
            self.nx.add_node(node.name)
            for slot, ref in enumerate(node.operands):
                if ref.node not in self._nodes:
                    raise GraphError(f"{node.where()}: operand {slot} refers to {ref.node!r}, "
                                     "which is not defined before it")
                if self.nx.has_edge(ref.node, node.name):
                    self.nx.edges[ref.node, node.name]["slots"] += (slot,)
                else:
                    self.nx.add_edge(ref.node, node.name, slots=(slot,))
        self.outputs = outputs
        self.meta = dict(meta or {})

    def __getstate__(self) -> dict:
        """Pickled and copied without ``fingerprint``'s memo (a hash object, which does not
        pickle)."""
        state = dict(self.__dict__)
        state.pop("_nodes_hash", None)
        state.pop("_ops", None)
        return state

    # -- access -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[OpNode]:
        return iter(self._nodes.values())

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, name: str) -> bool:
        return name in self._nodes

    def node(self, name: str) -> OpNode:
        return self._nodes[name]

    def spec(self, ref: ValueRef) -> TensorSpec:
        return self._nodes[ref.node].outputs[ref.index]

    def consumers(self, name: str) -> list[str]:
        return list(self.nx.successors(name))

    @property
    def params(self) -> dict[str, str]:
        """Parameter FQN -> node name, in capture order."""
        return {n.target: n.name for n in self if n.kind == "param" and n.target is not None}

    @property
    def inputs(self) -> list[str]:
        return [n.name for n in self if n.kind == "input"]

    @property
    def grads(self) -> dict[str, ValueRef]:
        return dict(self.outputs.grads)

    @property
    def buffer_updates(self) -> dict[str, ValueRef]:
        """Buffer FQN -> the value forward writes into it (empty for most models)."""
        return dict(self.outputs.buffer_updates)

    def ops(self) -> Iterator[OpNode]:
        ops = self.__dict__.get("_ops")
        if ops is None:     # the nodes never change: listed once (planning walks them often)
            ops = self.__dict__["_ops"] = tuple(n for n in self if not n.is_leaf)
        return iter(ops)

    def replace_nodes(self, updates: dict[str, OpNode]) -> OpGraph:
        """A new graph with some nodes replaced (same names); the input is left untouched."""
        return OpGraph([updates.get(n.name, n) for n in self], self.outputs, self.meta)

    # -- checks and identity ------------------------------------------------------------
    def check(self) -> None:
        """Verify the IR's invariants; errors name the node and its neighbours."""
        for node in self:
            if node.kind not in LEAF_KINDS + ("op",):
                raise GraphError(f"{node.where()}: unknown kind {node.kind!r}")
            if node.phase not in PHASES:
                raise GraphError(f"{node.where()}: unknown phase {node.phase!r}")
            if not node.outputs:
                raise GraphError(f"{node.where()}: produces no tensor")
            if node.aliases and not node.operands:
                raise GraphError(f"{node.where()}: a view needs the tensor it views (operand 0)")
            for spec in node.outputs:
                if any((not isinstance(s, int)) or s < 0 for s in spec.shape):
                    raise GraphError(f"{node.where()}: bad shape {spec.shape}")
            for slot, ref in enumerate(node.operands):
                producer = self._nodes[ref.node]
                if ref.index >= len(producer.outputs):
                    raise GraphError(
                        f"{node.where()}: operand {slot} reads output {ref.index} of "
                        f"{producer.where()}, which has {len(producer.outputs)} outputs")
                if producer.outputs[ref.index].is_absent:
                    raise GraphError(f"{node.where()}: operand {slot} reads output {ref.index} "
                                     f"of {producer.where()}, which the op does not produce")
        for ref in self.outputs.refs():
            if ref.node not in self._nodes:
                raise GraphError(f"graph output {ref} is not a node")
        outputs = ([("the loss", self.outputs.loss)] if self.outputs.loss is not None else []) + [
            (f"the gradient of {fqn!r}", r) for fqn, r in self.outputs.grads] + [
            (f"the update of buffer {fqn!r}", r) for fqn, r in self.outputs.buffer_updates] + [
            (f"the value sent to another stage ({r})", r) for r in self.outputs.sends]
        for what, ref in outputs:
            if ref.node in self._nodes and (
                    ref.index >= len(self._nodes[ref.node].outputs)
                    or self._nodes[ref.node].outputs[ref.index].is_absent):
                raise GraphError(f"{what} reads output {ref.index} of "
                                 f"{self._nodes[ref.node].where()}, which it does not produce")
        buffers = {n.target: n for n in self if n.kind == "buffer"}
        for fqn, ref in self.outputs.buffer_updates:
            if ref.node not in self._nodes:
                raise GraphError(f"the update of buffer {fqn!r} ({ref}) is not a node")
            if fqn not in buffers:
                raise GraphError(f"buffer update for {fqn!r}, which is not a buffer of the graph")
            if self.spec(ref).shape != buffers[fqn].output.shape:
                raise GraphError(f"the update of buffer {fqn!r} has shape "
                                 f"{self.spec(ref).shape}, the buffer "
                                 f"{buffers[fqn].output.shape}")
        if self.outputs.loss is not None and self.spec(self.outputs.loss).numel != 1:
            raise GraphError(f"the loss {self.outputs.loss} must be a scalar, "
                             f"got shape {self.spec(self.outputs.loss).shape}")

    def describe(self, name: str, context: int = 2) -> str:
        """A node with its neighbours, for error messages."""
        names = list(self._nodes)
        i = names.index(name)
        lines = []
        for j in range(max(0, i - context), min(len(names), i + context + 1)):
            n = self._nodes[names[j]]
            mark = ">>" if j == i else "  "
            ins = ", ".join(str(r) for r in n.operands)
            lines.append(f"{mark} {n.name} = {n.op}({ins}) -> {', '.join(map(str, n.outputs))}"
                         + (f"  # {n.module}" if n.module else ""))
        return "\n".join(lines)

    def fingerprint(self) -> str:
        """Hash of everything that affects planning: ops, args, shapes, edges, outputs."""
        # the nodes' part is hashed once per graph (its nodes are frozen and never
        # replaced: ``replace_nodes`` makes a new graph); outputs and meta may be set after
        nodes = self.__dict__.get("_nodes_hash")
        if nodes is None:
            nodes = hashlib.sha256()
            for n in self:
                nodes.update(json.dumps([n.name, n.op, n.kind, [str(r) for r in n.operands],
                                         repr(n.args), repr(n.kwargs), [str(s) for s in n.outputs],
                                         n.target, n.phase, n.aliases]
                                        + ([] if n.batched else ["unbatched"]),
                                        sort_keys=True).encode())
            self.__dict__["_nodes_hash"] = nodes
        h = nodes.copy()
        h.update(repr(self.outputs).encode())
        if self.meta.get("reduce_dtype"):   # gradients summed in a narrow dtype: other plans
            h.update(f"reduce_dtype={self.meta['reduce_dtype']}".encode())
        if self.meta.get("batch_split"):    # values crossing stages batch-split: other plans
            h.update(f"batch_split={sorted(self.meta['batch_split'])}".encode())
        return h.hexdigest()[:16]

    def summary(self) -> str:
        num_params = sum(self.node(n).output.numel for n in self.params.values())
        ops = sum(1 for _ in self.ops())
        return (f"OpGraph: {ops} ops, {len(self.params)} parameters ({num_params:,} elements), "
                f"{len(self.inputs)} inputs")
