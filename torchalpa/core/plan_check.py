"""Checks a plan passes before anything runs it: cached, loaded or given as ``plan=``.

A plan is data that may have been edited, truncated, swapped for another model's, or
written by another version. Reading one (``torchalpa.core.plan.read_plan_file``) turns
any unreadable file into a ``PlanError`` naming it; ``check_plan`` verifies that a plan fits the training step it is
about to drive -- the step's fingerprint, the mesh, the version, each parameter's shape,
every ``Shard(dim)`` dividing its dim evenly over its mesh axis, and the layouts agreeing
along every edge of the step's graph -- and names the file (or ``plan=``) and the fix.
"""

from __future__ import annotations

from torchalpa.core.placement import Placements, long_form, short, split_factor_of
from torchalpa.core.plan import INPUT_SLOT, PLAN_VERSION, PipelinePlan, Plan, PlanError

__all__ = ["PlanError", "check_plan", "check_step_dtypes"]


def check_plan(plan, *, fingerprint: str, source: str, mesh_shape=None, graph=None) -> None:
    """Raise ``PlanError`` unless ``plan`` (from ``source``) can drive the step whose graph
    has ``fingerprint`` on a mesh of ``mesh_shape`` (``None``: any). ``graph``, the
    captured OpGraph, enables the shape and per-edge layout checks."""
    if not isinstance(plan, (Plan, PipelinePlan)):
        raise PlanError(f"{source} must be a torchalpa.Plan, got {type(plan).__name__}")
    if plan.version != PLAN_VERSION:
        raise PlanError(f"{source} has version {plan.version}; this torchalpa runs version "
                        f"{PLAN_VERSION} -- plan again")
    if plan.graph_fingerprint != fingerprint:
        raise PlanError(f"{source} was made for a different training step (model, loss or "
                        "input shapes differ); plan again, or pass plan=None to solve now")
    if isinstance(plan, PipelinePlan):
        return
    shape = tuple(plan.mesh_shape)
    if not shape or any(not isinstance(s, int) or s < 1 for s in shape) \
            or len(plan.axis_names) != len(shape):
        raise PlanError(f"{source} has an invalid mesh {shape} with axes {plan.axis_names}")
    if mesh_shape is not None and shape != tuple(mesh_shape):
        raise PlanError(f"{source} is for a mesh of {shape}, this job's mesh is "
                        f"{tuple(mesh_shape)}")
    for value in plan.parameters + plan.inputs:
        _check_layout(value.placements, value.shape, shape, f"{source}: {value.name}")
    if graph is not None:
        _check_against_graph(plan, graph, source)


def _check_layout(placements: Placements, tensor_shape, mesh_shape, what: str) -> None:
    if len(placements) != len(mesh_shape):
        raise PlanError(f"{what} has {len(placements)} placements for a {len(mesh_shape)}-D mesh")
    local = list(tensor_shape)
    for axis, p in enumerate(placements):
        dim = getattr(p, "dim", None)
        if dim is None:
            continue
        if not 0 <= dim < len(local):
            raise PlanError(f"{what}: Shard({dim}) on mesh axis {axis}, but the tensor has "
                            f"{len(local)} dims {tuple(tensor_shape)}")
        pieces = split_factor_of(p)    # a strided shard splits each of its pieces
        if local[dim] % (mesh_shape[axis] * pieces):
            raise PlanError(f"{what}: {long_form(p)} splits dim {dim} of {tuple(tensor_shape)} "
                            f"({local[dim]} here) over {mesh_shape[axis]} devices unevenly"
                            + (f" in {pieces} pieces" if pieces > 1 else ""))
        local[dim] //= mesh_shape[axis]


def _check_against_graph(plan: Plan, graph, source: str) -> None:
    """Shapes as captured, and on every edge the layout arriving (the producer's, after
    the planned reshard if any) equal to the layout its consumer reads."""
    layout: dict[tuple[str, int], Placements] = {}
    for s in plan.strategies:
        for i, p in enumerate(s.outputs):
            layout[(s.node, i)] = p
    for value in plan.parameters + plan.inputs:
        if value.node not in graph:
            raise PlanError(f"{source}: {value.name} (node {value.node}) is not in this step")
        captured = tuple(graph.node(value.node).output.shape)
        if tuple(value.shape) != captured:
            raise PlanError(f"{source}: {value.name} has shape {tuple(value.shape)}, the model's "
                            f"is {captured}")
        planned = layout.setdefault((value.node, 0), value.placements)
        if planned != value.placements:
            raise PlanError(f"{source}: {value.name} is placed {short(value.placements)} but its "
                            f"node's strategy writes {short(planned)}; the plan was edited "
                            "inconsistently -- plan again")
    reshards = {}
    for r in plan.reshards:
        reshards[(r.producer, r.index, r.consumer, r.slot)] = r
        for a, b in zip(r.steps, r.steps[1:]):
            if a.dst != b.src:
                raise PlanError(f"{source}: the reshard of {r.producer} for {r.consumer} jumps "
                                f"from {short(a.dst)} to {short(b.src)}")
        # a user input's reshard starts from the global batch (replicated), not its layout
        src = None if r.slot == INPUT_SLOT else layout.get((r.producer, r.index))
        if r.steps and src is not None and r.steps[0].src != src:
            raise PlanError(f"{source}: the reshard of {r.producer} for {r.consumer} starts "
                            f"from {short(r.steps[0].src)}, but {r.producer} is "
                            f"{short(src)}; the plan was edited inconsistently -- plan again")
    for s in plan.strategies:
        if s.node not in graph:
            raise PlanError(f"{source}: a strategy for {s.node}, which is not in this step")
        node = graph.node(s.node)
        for slot, (ref, want) in enumerate(zip(node.operands, s.inputs)):
            if want is None:
                continue
            r = reshards.get((ref.node, ref.index, s.node, slot))
            if r is not None and r.same_as is not None:     # reads another read's copy
                r = reshards.get((ref.node, ref.index, *r.same_as))
            arriving = r.steps[-1].dst if r is not None and r.steps else \
                layout.get((ref.node, ref.index))
            if arriving is not None and arriving != want:
                raise PlanError(f"{source}: {s.node} ({node.module or 'top level'}) reads operand "
                                f"{slot} as {short(want)}, but {ref} arrives as "
                                f"{short(arriving)}; the plan was edited inconsistently -- "
                                "plan again")


_SAME_DTYPE_OPS = ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten.matmul.",
                   "aten.dot.", "aten.linear.", "aten.convolution.")


_FLOAT_NAMES = ("float64", "float32", "float16", "bfloat16")


def check_step_dtypes(graph) -> None:
    """Matrix products and convolutions whose operands have different dtypes (integer
    features fed to a Linear, say) fail on the first step, not when captured on fake
    tensors: refuse them at plan time, naming the module and the operand."""
    for node in graph.ops():
        if not node.op.startswith(_SAME_DTYPE_OPS):
            continue
        dtypes = [graph.spec(ref).dtype for ref in node.operands]
        if len(set(dtypes)) > 1:
            names = ", ".join(f"{ref} {str(d).removeprefix('torch.')}"
                              for ref, d in zip(node.operands, dtypes))
            if all(str(d).removeprefix("torch.") in _FLOAT_NAMES for d in dtypes):
                advice = ("A float32 tensor the model makes itself (a buffer, a table such as "
                          "rotary cos/sin) meets a lower-precision one, as under "
                          "MixedPrecision; cast it where it is used (.type_as(x)), as "
                          "HuggingFace models do, or keep the model in one dtype")
            else:
                advice = ("Give example inputs (and real batches) of the dtype the model "
                          "computes in -- e.g. float features (x.float()); integer tensors "
                          "only as indices or targets")
            raise TypeError(f"{node.module or 'the model'}: {node.op} multiplies operands of "
                            f"different dtypes ({names}); the step would fail on its first "
                            f"call. {advice}")
