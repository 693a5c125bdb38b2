"""Read a training step written in StableHLO (from JAX or torch-mlir) as an OpGraph.

The step is a ``func.func @main`` whose arguments are the parameters first, then the
batch (inputs, targets), and whose results are the loss followed by one gradient per
parameter, in parameter order: what ``jax.value_and_grad`` of a loss function returns
once flattened, and what ``torchalpa.export_stablehlo`` writes. ``num_params`` says how
many leading arguments are parameters and ``param_names`` names them; without names, an
argument attribute ``torchalpa.name`` or its location (JAX writes ``loc("params['w1']")``)
is used, else ``param<i>`` / ``input<i>``.

Every StableHLO op becomes ops of the ATen vocabulary the torch frontend produces, so the
two frontends share one set of sharding rules (``passes/rules``) and one cost model:

- elementwise ops, ``compare``, ``select``, ``convert`` -> their ATen pointwise op;
- ``transpose`` -> ``aten.permute``, ``reshape`` -> ``aten.reshape`` (as a view: no bytes moved;
  a reshape of a reshape is one);
- ``broadcast_in_dim`` -> ``aten.permute``/``aten.reshape`` (insert the new unit dims) then
  ``aten.expand``;
- ``constant`` -> ``aten.full`` (its splat value, ``nan`` for other constants); shape ops
  and casts of a constant stay constants; a constant operand of an elementwise op becomes
  a 0-d ``aten.full`` that broadcasts, as ATen's ``scalar_tensor``; arithmetic on
  constants is folded, and ``x * 1``, ``x / 1``, ``x ** 1``, ``x + 0``, ``x - 0`` are ``x``;
- ``dot_general`` -> ``aten.mm`` (no batch dims), ``aten.bmm`` (one) or
  ``torchalpa::batched_matmul`` (several, or one that merges several: attention's
  ``B * H``), with the permutes and views that bring its operands to (batch, rows,
  contracted) x (batch, contracted, cols), as ``torch.matmul`` does (``frontends/hlo_dot.py``);
- ``reduce`` whose body is an add / max / min / and / or -> ``aten.sum.dim_IntList`` /
  ``aten.amax`` / ``aten.amin`` / ``aten.all`` / ``aten.any`` (the init value is taken to be
  the identity, as JAX and torch-mlir write it);
- ``slice`` along one dim -> ``aten.slice.Tensor``; ``concatenate`` -> ``aten.cat``;
  ``iota`` (and a 1-D ``dynamic_iota``) -> ``aten.arange`` (made whole: every dim blocked);
- ``gather`` of whole rows of a 2-D table -> ``aten.embedding``; ``scatter``-add of rows
  into a zero table (its gradient) -> ``aten.embedding_dense_backward``;
- ``gather`` of one element per position (cross entropy's target pick) ->
  ``aten.gather``, and its gradient -> ``aten.scatter_add`` (``frontends/hlo_gather.py``);
- ``func.call`` is inlined.

Op bytes are what XLA's fusion moves: values passed between elementwise ops (and into
reductions) are never written to memory (``torchalpa/core/fusion.py``), so a softmax spelled
as five ops costs what ATen's one ``_softmax`` does.

Any other op keeps its StableHLO name (``stablehlo.gather``...): it has no rule, so the
planner runs it replicated and lists it in the plan's ``unsupported_ops``, as for torch.
``OpNode.source`` holds the op's name and location in the StableHLO text; ``stack`` the
"file:line" of the user's code JAX or ``export_stablehlo`` recorded, and ``module`` the
module path an exported torch step names (``loc("net.0"("model.py":40:0))``), so errors and
the plan's list of ops without a rule point at the model's code.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

from torchalpa.core.fusion import fuse_elementwise_bytes
from torchalpa.core.opgraph import GraphOutputs, Operand, OpGraph, OpNode, TensorSpec, ValueRef
from torchalpa.frontends.hlo_readers import (
    ELEMENTWISE,
    READERS,
    OpAt,
    StableHLOError,
    gather_dims_of,
    ints_of,
)
from torchalpa.frontends.hlo_slices import equal_slices_as_split
from torchalpa.frontends.hlo_sums import sum_products_first

__all__ = ["from_stablehlo", "read_program", "ReadProgram", "parse_module", "StableHLOError", "ELEMENTWISE"]


_DTYPES = {"f64": "float64", "f32": "float32", "f16": "float16", "bf16": "bfloat16",
           "i64": "int64", "i32": "int32", "i16": "int16", "i8": "int8", "ui8": "uint8",
           "i1": "bool", "complex<f32>": "complex64"}

_CONSTANTS = ("stablehlo.constant", "arith.constant")
_SHAPE_OPS = ("stablehlo.convert", "stablehlo.reshape", "stablehlo.broadcast_in_dim",
              "stablehlo.transpose")
_FOLD = {"stablehlo.add": lambda a, b: a + b, "stablehlo.subtract": lambda a, b: a - b,
         "stablehlo.multiply": lambda a, b: a * b, "stablehlo.divide": lambda a, b: a / b,
         "stablehlo.maximum": max, "stablehlo.minimum": min, "stablehlo.negate": lambda a: -a,
         "stablehlo.power": lambda a, b: a ** b}
_IDENTITY_WITH = {"stablehlo.multiply": 1.0, "stablehlo.divide": 1.0, "stablehlo.power": 1.0,
                  "stablehlo.add": 0.0, "stablehlo.subtract": 0.0}
_FLOATS = ("float64", "float32", "float16", "bfloat16")
_VIEWS = ("aten.reshape.default", "aten.permute.default", "aten.expand.default")


def parse_module(text: str):
    """StableHLO text -> an MLIR module (jaxlib's bindings); the caller keeps its context."""
    try:
        from jax._src.interpreters import mlir as jax_mlir
        from jax._src.lib.mlir import ir
    except ImportError as e:
        raise ImportError("reading StableHLO needs jaxlib's MLIR bindings: "
                          "pip install 'torchalpa[stablehlo]' (jax, jaxlib)") from e
    context = jax_mlir.make_ir_context()
    context.allow_unregistered_dialects = True
    with context:
        try:
            return ir.Module.parse(text), context
        except Exception as e:  # MLIRError: the message has the diagnostics
            raise StableHLOError(f"could not parse the StableHLO text: {e}") from e


def from_stablehlo(text: str, *, num_params: int | None = None,
                   param_names: Sequence[str] | None = None,
                   input_names: Sequence[str] | None = None) -> OpGraph:
    """The training step in ``text`` (``@main``: params, batch -> loss, grads) as an OpGraph."""
    module, context = parse_module(text)
    with context:
        return _Reader(module).graph(num_params, param_names, input_names)


@dataclass(frozen=True)
class ReadProgram:
    """A StableHLO step read as an OpGraph, with the way back from the graph to the text:
    ``values`` maps a graph value to the MLIR value it stands for (where one does: views
    the reader inserts stand for none), ``ops`` a node to the MLIR op it was read from.
    Used to annotate the program with a plan made from it (``torchalpa/interop/hlo_annotate.py``);
    ``module`` lives in ``context``."""

    graph: OpGraph
    module: object
    context: object
    values: dict
    ops: dict


def read_program(text: str, *, num_params: int | None = None,
                 param_names: Sequence[str] | None = None,
                 input_names: Sequence[str] | None = None) -> ReadProgram:
    """``from_stablehlo`` that keeps the parsed module and the graph-to-MLIR maps."""
    module, context = parse_module(text)
    with context:
        reader = _Reader(module)
        graph = reader.graph(num_params, param_names, input_names)
    values: dict = {}
    for value, ref in reader.refs.items():
        values.setdefault(ref, value)
    return ReadProgram(graph, module, context, values, dict(reader.op_of))


# -- attribute text -------------------------------------------------------------------

def _spec(ir_type) -> TensorSpec:
    text = str(ir_type)
    m = re.fullmatch(r"tensor<(.*)>", text)
    if not m:
        raise StableHLOError(f"only ranked tensors are supported, got {text}")
    *dims, elem = re.split(r"x(?![^<]*>)", m.group(1))   # 4x16xf32; complex<f32> stays whole
    if any(not d.isdigit() for d in dims):
        raise StableHLOError(f"dynamic shape {text}: torchalpa plans static shapes; lower the "
                             "step with concrete example shapes")
    if elem not in _DTYPES:
        raise StableHLOError(f"element type {elem!r} of {text} is not supported")
    return TensorSpec(tuple(int(d) for d in dims), _DTYPES[elem])


def _splat(text: str) -> float:
    """The fill value of a splat constant (``dense<2.0> : tensor<4xf32>``); ``nan`` for one
    that holds different values (read as a non-zero fill: never a Partial sum)."""
    m = re.fullmatch(r"dense<([^\[\]<>\"]*)>\s*:.*", text.strip())
    if not m:
        return float("nan")
    value = m.group(1).strip()
    if value in ("true", "false"):
        return float(value == "true")
    if value.startswith("0x"):                 # raw bits: -inf is 0xFF800000 in f32
        elem = re.search(r"x?(f64|f32|f16|bf16)>\s*$", text.strip())
        bits = int(value, 16).to_bytes(len(value[2:]) // 2, "big")
        formats = {"f64": ">d", "f32": ">f", "f16": ">e"}
        if elem and elem.group(1) == "bf16" and len(bits) == 2:
            return struct.unpack(">f", bits + b"\0\0")[0]
        if elem and elem.group(1) in formats and \
                len(bits) == struct.calcsize(formats[elem.group(1)]):
            return struct.unpack(formats[elem.group(1)], bits)[0]
        return float("nan")
    try:
        return float(value)
    except ValueError:
        return float("nan")


def _location(op) -> tuple[str, str]:
    """(location name, "file:line") of an op, from JAX's or torch-mlir's loc(): the name is
    JAX's op path or the module path ``torchalpa.export_stablehlo`` writes; the line is the
    innermost frame outside installed packages (JAX and torch-mlir list callers after)."""
    text = str(op.location)
    name = re.match(r'loc\("([^"]*)"', text)
    lines = re.findall(r'"([^"]+\.py)":(\d+)', text)
    user = [f"{f}:{n}" for f, n in lines if f"{os.sep}site-packages{os.sep}" not in f]
    line = user[0] if user else (f"{lines[0][0]}:{lines[0][1]}" if lines else "")
    return (name.group(1) if name else ""), line


# a location name that is a torch module path ("h.0.attn.c_proj"), not JAX's op path
_MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.\w+)*")


class _Reader:
    """Walks ``@main`` (inlining calls) and emits OpNodes in the ATen vocabulary."""

    def __init__(self, module):
        self.funcs = {}
        for op in module.body.operations:
            op = op.operation
            if op.name == "func.func":
                self.funcs[str(op.attributes["sym_name"]).strip('"')] = op
        if "main" not in self.funcs:
            raise StableHLOError(f"the module has no func.func @main (found "
                                 f"{sorted(self.funcs) or 'none'}); torchalpa reads the step "
                                 "from @main")
        self.nodes: list[OpNode] = []
        self.by_name: dict[str, OpNode] = {}
        self.refs: dict = {}          # ir.Value -> ValueRef
        self.constants: dict = {}     # value made by a constant (or its broadcast) -> fill
        self.count = 0
        self.op_of: dict[str, object] = {}   # node name -> the MLIR op it was read from
        self._reading = None                  # the MLIR op being read
        self._module = ""                     # its module path, when its location names one

    # -- emitting ------------------------------------------------------------------------
    def _name(self, what: str) -> str:
        self.count += 1
        return f"{what}_{self.count}"

    def emit(self, op: str, operands: list[ValueRef], out: TensorSpec | Sequence[TensorSpec],
             args: tuple = (), kwargs: tuple = (), *, source, stack="", flops=None) -> ValueRef:
        outs = (out,) if isinstance(out, TensorSpec) else tuple(out)
        aliases = op in _VIEWS
        if flops is None:
            flops = 0.0 if aliases or op in ("aten.full.default", "aten.arange.default",
                                             "aten.cat.default", "aten.slice.Tensor") \
                else float(sum(o.numel for o in outs))
        in_bytes = sum(self.spec(r).nbytes for r in operands)
        node = OpNode(name=self._name(op.split(".")[1]), op=op, operands=tuple(operands),
                      args=args, kwargs=kwargs, outputs=outs, flops=float(flops),
                      bytes=0.0 if aliases else float(in_bytes + sum(o.nbytes for o in outs)),
                      aliases=aliases, source=source, stack=stack, module=self._module)
        self.add(node)
        return ValueRef(node.name)

    def add(self, node: OpNode) -> None:
        self.nodes.append(node)
        self.by_name[node.name] = node
        if self._reading is not None:
            self.op_of[node.name] = self._reading

    def spec(self, ref: ValueRef) -> TensorSpec:
        return self.by_name[ref.node].outputs[ref.index]

    # -- the step ------------------------------------------------------------------------
    def graph(self, num_params, param_names, input_names) -> OpGraph:
        main = self.funcs["main"]
        block = main.regions[0].blocks[0]
        args = list(block.arguments)
        names, marked = self._arg_names(main, args)
        num_params = len(param_names) if num_params is None and param_names is not None \
            else num_params
        if num_params is None and "param" in marked:
            num_params = marked.count("param")
        if num_params is None:
            raise StableHLOError("say which arguments of @main are parameters: num_params= "
                                 "(the first num_params arguments) or param_names=")
        if not 0 < num_params <= len(args):
            raise StableHLOError(f"num_params={num_params}, but @main has {len(args)} "
                                 "arguments; the parameters come first")
        if param_names is not None:
            if len(param_names) != num_params:
                raise StableHLOError(f"{len(param_names)} param_names for {num_params} "
                                     "parameters")
            names[:num_params] = list(param_names)
        if input_names is not None:
            names[num_params:num_params + len(input_names)] = list(input_names)
        for i, (arg, name) in enumerate(zip(args, names)):
            kind = "param" if i < num_params else "buffer" if marked[i] == "buffer" \
                else "input"
            name = name or (f"param{i}" if kind == "param" else f"input{i - num_params}")
            node = OpNode(name=f"arg{i}", op=kind, kind=kind, outputs=(_spec(arg.type),),
                          target=name, is_param=kind == "param", source=f"%arg{i}")
            self.add(node)
            self.refs[arg] = ValueRef(node.name)
        results = self._body(block)
        if len(results) != 1 + num_params:
            raise StableHLOError(
                f"@main returns {len(results)} values; a training step returns the loss and "
                f"one gradient per parameter ({1 + num_params}): lower "
                "jax.value_and_grad(loss_fn) of the parameters, not the loss alone")
        loss, grads = results[0], results[1:]
        targets = [n.target or n.name for n in self.nodes[:num_params]]
        for (fqn, g), arg in zip(zip(targets, grads), args):
            if self.spec(g).shape != _spec(arg.type).shape:
                raise StableHLOError(f"result for the gradient of {fqn!r} has shape "
                                     f"{self.spec(g).shape}, the parameter "
                                     f"{_spec(arg.type).shape}; results must be (loss, "
                                     "*grads) in parameter order")
        return self._finish(loss, list(zip(targets, grads)))

    def _arg_names(self, main, args) -> tuple[list[str], list[str]]:
        """Per argument: its name and its ``torchalpa.kind`` mark ("" when unmarked)."""
        names, kinds = [""] * len(args), [""] * len(args)
        arg_attrs = main.attributes["arg_attrs"] if "arg_attrs" in main.attributes else None
        for i, arg in enumerate(args):
            attrs = str(arg_attrs[i]) if arg_attrs is not None else ""
            m = re.search(r'torchalpa.name = "([^"]*)"', attrs)
            kind = re.search(r'torchalpa.kind = "([^"]*)"', attrs)
            loc = re.fullmatch(r'loc\("([^"]*)"\)', str(arg.location))
            names[i] = m.group(1) if m else (_pytree_name(loc.group(1)) if loc else "")
            kinds[i] = kind.group(1) if kind else ""
        return names, kinds

    def _finish(self, loss: ValueRef, grads: list[tuple[str, ValueRef]]) -> OpGraph:
        by_name = {n.name: n for n in self.nodes}
        forward, stack = set(), [loss.node]
        while stack:
            name = stack.pop()
            if name not in forward:
                forward.add(name)
                stack.extend(r.node for r in by_name[name].operands)
        grad_nodes = {r.node for _, r in grads}
        live, stack = set(), [loss.node] + [r.node for _, r in grads]
        while stack:                      # drop what no output needs (dead constants)
            name = stack.pop()
            if name not in live:
                live.add(name)
                stack.extend(r.node for r in by_name[name].operands)
        nodes = [replace(n, phase="forward" if n.name in forward else "backward",
                         is_grad=n.name in grad_nodes and n.kind == "op")
                 for n in self.nodes if n.is_leaf or n.name in live]
        outputs = GraphOutputs(loss=loss, grads=tuple(grads))
        by_name = {n.name: n for n in nodes}
        nodes = equal_slices_as_split(nodes, lambda r: by_name[r.node].outputs[r.index],
                                      {r.node for r in outputs.refs()})
        graph = OpGraph(fuse_elementwise_bytes(sum_products_first(nodes), outputs), outputs,
                        meta={"frontend": "stablehlo"})
        graph.check()
        return graph

    def _body(self, block) -> list[ValueRef]:
        """Emit the ops of a function body; the values it returns."""
        for op in block.operations:
            op = op.operation
            if op.name in ("func.return", "stablehlo.return"):
                return [self.refs[v] for v in op.operands]
            self._op(op)
        raise StableHLOError("a function body without a return")

    def _op(self, op) -> None:
        """Read one op: inline a call, keep a constant, drop an identity, else the reader
        registered for its name (``frontends/hlo_readers.py``); an op no reader takes keeps
        its StableHLO name and has no rule (replicated, listed in the plan)."""
        self._reading = op
        where, stack = _location(op)
        self._module = where if _MODULE_PATH.fullmatch(where) else ""
        at = OpAt(op, op.name, f"{op.name} {where}".strip(), stack,
                  [_spec(r.type) for r in op.results], list(op.operands))
        if self._passes_through(at):
            return
        value = self._constant_value(at)
        if value is not None:
            self.constants[op.results[0]] = value
            self.refs[op.results[0]] = self.emit("aten.full.default", [], at.outs[0],
                                                 (at.outs[0].shape, value), source=at.source,
                                                 stack=stack)
            return
        at.refs = [self.refs[v] for v in at.ins]
        reader = READERS.get(at.name)
        result = self._identity(at) or (reader(self, at) if reader else None)
        if result is None:
            ref = self.emit(at.name, at.refs, at.outs,
                            tuple(Operand(k) for k in range(len(at.refs))),
                            source=at.source, stack=stack)
            result = [ValueRef(ref.node, i) for i in range(len(at.outs))]
        for i, ref in enumerate(result if isinstance(result, list) else [result]):
            self.refs[op.results[i]] = ref

    def _passes_through(self, at: OpAt) -> bool:
        """A call is inlined and a barrier forwards its operands: no op of their own."""
        if at.name == "func.call":
            callee = self.funcs[str(at.op.attributes["callee"]).lstrip("@").strip('"')]
            body = callee.regions[0].blocks[0]
            for formal, actual in zip(body.arguments, at.ins):
                self.refs[formal] = self.refs[actual]
                if actual in self.constants:
                    self.constants[formal] = self.constants[actual]
            results = self._body(body)
        elif at.name == "stablehlo.optimization_barrier":
            results = [self.refs[v] for v in at.ins]
        else:
            return False
        for i, ref in enumerate(results):
            self.refs[at.op.results[i]] = ref
        return True

    def _constant_value(self, at: OpAt) -> float | None:
        """The splat value of a constant, of a shape op or cast of a constant, and of
        arithmetic on constants (folded); None for an op that is not a constant."""
        name, ins = at.name, at.ins
        if name in _CONSTANTS:
            return _splat(str(at.op.attributes["value"]))
        if ins and ins[0] in self.constants and name in _SHAPE_OPS:    # still a constant
            value = self.constants[ins[0]]
            if name == "stablehlo.convert" and at.outs[0].dtype not in _FLOATS and \
                    value == value:
                value = float(int(value))
            return value
        if name in _FOLD and ins and all(v in self.constants for v in ins):   # constant math
            try:
                return float(_FOLD[name](*(self.constants[v] for v in ins)))
            except (ArithmeticError, ValueError):
                return float("nan")
        return None

    def _identity(self, at: OpAt) -> ValueRef | None:
        """``x * 1``, ``x / 1``, ``x ** 1``, ``x + 0``, ``x - 0`` and ``1 * x`` are ``x``."""
        ins = at.ins
        if at.name in _IDENTITY_WITH and len(ins) == 2 and \
                self.constants.get(ins[1]) == _IDENTITY_WITH[at.name] and \
                ins[0] not in self.constants:
            return at.refs[0]
        if at.name == "stablehlo.multiply" and self.constants.get(ins[0]) == 1.0:
            return at.refs[1]
        return None

    def _row_indices(self, ref: ValueRef, index_vector_dim: int, source, stack):
        """Indices of one row each: ``(*I)``, or ``(*I, 1)`` with the index vector last,
        as the ``(*I)`` tensor ``aten.embedding`` takes; None for other index layouts."""
        shape = self.spec(ref).shape
        if index_vector_dim == len(shape):
            return ref
        if index_vector_dim == len(shape) - 1 and shape[-1] == 1:
            return self.view(ref, shape[:-1], source, stack)
        return None

    def embedding_lookup(self, op, refs):
        """A ``gather`` that takes whole rows of a 2-D table (``jnp.take(w, ids, axis=0)``,
        torch's ``embedding``): (weight, indices) for ``aten.embedding``, else None."""
        dims = gather_dims_of(str(op.attributes["dimension_numbers"]))
        table = self.spec(refs[0]).shape
        sizes = ints_of(str(op.attributes["slice_sizes"]))
        if len(table) != 2 or dims["collapsed_slice_dims"] != [0] or \
                dims["start_index_map"] != [0] or sizes != [1, table[1]] or \
                dims["operand_batching_dims"]:
            return None
        where, stack = _location(op)
        indices = self._row_indices(refs[1], (dims["index_vector_dim"] or [0])[0],
                                    f"{op.name} {where}".strip(), stack)
        if indices is None or dims["offset_dims"] != [len(self.spec(indices).shape)]:
            return None
        return refs[0], indices

    def embedding_grad(self, op, ins, refs):
        """A ``scatter`` that adds rows into a zero table (the backward of an embedding
        lookup): (grad, indices) for ``aten.embedding_dense_backward``, else None."""
        dims = gather_dims_of(str(op.attributes["scatter_dimension_numbers"]))
        table = self.spec(refs[0]).shape
        if len(ins) != 3 or len(table) != 2 or self.reduce_body(op) != "stablehlo.add" or \
                self.constants.get(ins[0]) != 0.0 or dims["inserted_window_dims"] != [0] or \
                dims["scatter_dims_to_operand_dims"] != [0] or dims["input_batching_dims"]:
            return None
        where, stack = _location(op)
        indices = self._row_indices(refs[1], (dims["index_vector_dim"] or [0])[0],
                                    f"{op.name} {where}".strip(), stack)
        if indices is None:
            return None
        rows = self.spec(indices).shape
        if dims["update_window_dims"] != [len(rows)] or \
                self.spec(refs[2]).shape != rows + (table[1],):
            return None
        return self._rows_kept_by_bounds(refs[2], indices), self._unclamped(indices, table[0])

    # An embedding's gradient lowered to StableHLO (torch-mlir) checks its indices before the
    # scatter: ``clamp(ids, -V, V - 1)`` and ``where(0 <= ids < V and ids != -1, grad, 0)``.
    # ATen's ``embedding_dense_backward`` does both inside the op, so the two frontends read
    # the same step only if these become part of it: otherwise the mask is one more
    # elementwise pass over the gradient rows that sharding the table's columns makes 4x
    # cheaper, a preference the ATen graph does not have (issue 18, item 3). A mask a
    # program writes itself from the same indices (padding rows) reads the same way: the
    # graph is what the planner prices -- same shapes, same strategies -- while XLA runs
    # the program as written.
    def _unclamped(self, indices: ValueRef, vocab: int) -> ValueRef:
        """``ids`` for ``clamp(ids, lo, V - 1)`` with ``-V <= lo <= 0``; else ``indices``."""
        node = self.by_name[indices.node]
        if node.op != "aten.clamp.Tensor" or len(node.operands) != 3:
            return indices
        low, high = (self._fill(r) for r in node.operands[1:])
        if low is None or high is None or not (-vocab <= low <= 0) or high != vocab - 1:
            return indices
        return node.operands[0]

    def _rows_kept_by_bounds(self, grad: ValueRef, indices: ValueRef) -> ValueRef:
        """The gradient rows before ``where(mask, grad, 0)`` (either branch order), when the
        mask is computed from integer tensors only and reads the scattered indices (or
        their unclamped source); else ``grad``."""
        node = self.by_name[grad.node]
        if node.op != "aten.where.self" or len(node.operands) != 3:
            return grad
        cond, a, b = node.operands
        kept = b if self._fill(a) == 0.0 else a if self._fill(b) == 0.0 else None
        if kept is None or self.spec(kept).shape != self.spec(grad).shape:
            return grad
        clamp = self.by_name[indices.node]
        sources = {indices.node} | ({clamp.operands[0].node}
                                    if clamp.op == "aten.clamp.Tensor" else set())
        seen, stack, reads_indices = set(), [cond.node], False
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            reads_indices |= name in sources
            upstream = self.by_name[name]
            if upstream.op != "aten.full.default" and \
                    any(o.dtype in _FLOATS for o in upstream.outputs):
                return grad          # a mask that reads values, not only indices: keep it
            if name not in sources:
                stack.extend(r.node for r in upstream.operands)
        return kept if reads_indices else grad

    def _fill(self, ref: ValueRef) -> float | None:
        """The value a scalar constant (``aten.full``) holds, else None."""
        node = self.by_name[ref.node]
        if node.op != "aten.full.default" or len(node.args) < 2:
            return None
        return float(node.args[1])

    @staticmethod
    def reduce_body(op) -> str:
        body = list(op.regions[0].blocks[0].operations)
        return body[0].operation.name if len(body) == 2 else ""

    def one_dim_slice(self, op, ref):
        shape = self.spec(ref).shape
        starts = ints_of(str(op.attributes["start_indices"]))
        limits = ints_of(str(op.attributes["limit_indices"]))
        strides = ints_of(str(op.attributes["strides"]))
        cut = [d for d in range(len(shape))
               if (starts[d], limits[d], strides[d]) != (0, shape[d], 1)]
        if len(cut) > 1:
            return None
        d = cut[0] if cut else 0
        return d, starts[d], limits[d], strides[d]

    # -- shape ops in ATen terms -----------------------------------------------------------
    def view(self, ref: ValueRef, shape, source, stack) -> ValueRef:
        """``ref`` reshaped; a reshape of a reshape is one reshape of the first's operand
        (so ``(B, H, S, S) -> (B * H, S, S) -> (B, H, S, S)`` leaves the heads a dim)."""
        spec = self.spec(ref)
        if tuple(shape) == spec.shape:
            return ref
        producer = self.by_name[ref.node]
        if producer.op == "aten.reshape.default":
            return self.view(producer.operands[0], shape, source, stack)
        return self.emit("aten.reshape.default", [ref], TensorSpec(tuple(shape), spec.dtype),
                         (Operand(0), tuple(shape)), source=source, stack=stack)

    def permute(self, ref: ValueRef, perm, source, stack) -> ValueRef:
        spec = self.spec(ref)
        if list(perm) == list(range(len(perm))):
            return ref
        shape = tuple(spec.shape[p] for p in perm)
        return self.emit("aten.permute.default", [ref], TensorSpec(shape, spec.dtype),
                         (Operand(0), tuple(perm)), source=source, stack=stack)

    def broadcast(self, ref: ValueRef, dims, shape, source, stack) -> ValueRef:
        """``broadcast_in_dim``: operand dim i becomes result dim ``dims[i]``."""
        spec = self.spec(ref)
        order = sorted(range(len(dims)), key=lambda i: dims[i])
        ref = self.permute(ref, order, source, stack)          # operand dims in result order
        placed = {dims[i]: spec.shape[i] for i in range(len(dims))}
        unit = tuple(placed.get(d, 1) for d in range(len(shape)))
        ref = self.view(ref, unit, source, stack)              # the new dims, of size 1
        if unit == tuple(shape):
            return ref
        return self.emit("aten.expand.default", [ref], TensorSpec(tuple(shape), spec.dtype),
                         (Operand(0), tuple(shape)), source=source, stack=stack)


def _pytree_name(path: str) -> str:
    """``params['w1'][0]`` -> ``params.w1.0`` (how plans name JAX parameters)."""
    parts = re.findall(r"\[\'([^\']*)\'\]|\[(\d+)\]|\.(\w+)|^(\w+)", path)
    names = [next(p for p in groups if p) for groups in parts]
    return ".".join(names) if names else path
