"""Lower a JAX training step to StableHLO text, with the names of its parameters.

``lower_jax(fn, example_args, param_argnums=0)``: ``fn(*args)`` returns the scalar loss
(torchalpa differentiates it with ``jax.value_and_grad`` over the arguments at
``param_argnums``), or already ``(loss, grads)`` with ``grads`` shaped like those
arguments. The lowered ``@main`` takes the parameter leaves, then every other leaf of the
arguments (the batch), and returns ``(loss, *grads)``: the convention
``frontends/stablehlo.py`` reads. Leaves are named by their pytree path under the
argument's name (``params.layers.0.w``), which is how the plan names them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["LoweredStep", "lower_jax", "leaf_names", "normalize_argnums", "argument_names"]


@dataclass(frozen=True)
class LoweredStep:
    """A JAX step lowered to StableHLO: the text and what its arguments are."""

    text: str
    param_names: tuple[str, ...]
    input_names: tuple[str, ...]


def normalize_argnums(param_argnums, num_args: int) -> tuple[int, ...]:
    argnums = (param_argnums,) if isinstance(param_argnums, int) else tuple(param_argnums)
    if not argnums or any(not isinstance(a, int) or not -num_args <= a < num_args
                          for a in argnums):
        raise ValueError(f"param_argnums must name arguments of the step (0..{num_args - 1}), "
                         f"got {param_argnums!r}")
    return tuple(sorted({a % num_args for a in argnums}))


def argument_names(fn: Callable, num_args: int) -> list[str]:
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"arg{i}" for i in range(num_args)]


def leaf_names(tree, prefix: str) -> list[str]:
    """Dotted names of a pytree's leaves, in ``jax.tree_util`` flatten order."""
    import jax
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [prefix]
        for key in path:
            for attr in ("key", "idx", "name"):
                if hasattr(key, attr):
                    parts.append(str(getattr(key, attr)))
                    break
        names.append(".".join(parts))
    return names


def lower_jax(fn: Callable, example_args: Sequence, param_argnums=0) -> LoweredStep:
    """``fn``'s loss and gradients over ``param_argnums`` as StableHLO text."""
    import jax
    import jax.numpy as jnp

    example_args = tuple(example_args)
    argnums = normalize_argnums(param_argnums, len(example_args))
    names = argument_names(fn, len(example_args))
    params: tuple = tuple(example_args[i] for i in argnums)
    rest = [i for i in range(len(example_args)) if i not in argnums]
    batch = tuple(example_args[i] for i in rest)

    def call(params, batch):
        args = [None] * len(example_args)
        for i, p in zip(argnums, params):
            args[i] = p
        for i, b in zip(rest, batch):
            args[i] = b
        return fn(*args)

    out = jax.eval_shape(call, params, batch)
    if isinstance(out, jax.ShapeDtypeStruct) and out.shape == ():
        step = jax.value_and_grad(call)
    elif isinstance(out, (tuple, list)) and len(out) == 2 and getattr(out[0], "shape", 1) == () \
            and jax.tree_util.tree_structure(out[1]) == jax.tree_util.tree_structure(
                params if len(params) != 1 else params[0]):    # argnums is never empty
        def step(params, batch):
            loss, grads = call(params, batch)
            return loss, (grads if len(params) > 1 else (grads,))
    else:
        raise ValueError("a JAX step for torchalpa returns the scalar loss (torchalpa takes "
                         "its gradient) or (loss, grads) with grads shaped like the "
                         f"parameters; got {jax.tree_util.tree_map(lambda s: s.shape, out)}")
    param_leaves, param_tree = jax.tree_util.tree_flatten(params)
    batch_leaves, batch_tree = jax.tree_util.tree_flatten(batch)

    def flat(*leaves):
        p = jax.tree_util.tree_unflatten(param_tree, leaves[:len(param_leaves)])
        b = jax.tree_util.tree_unflatten(batch_tree, leaves[len(param_leaves):])
        loss, grads = step(p, b)
        return (loss, *jax.tree_util.tree_leaves(grads))

    shapes = [jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))
              for x in param_leaves + batch_leaves]
    text = jax.jit(flat, keep_unused=True).lower(*shapes).as_text(debug_info=True)
    param_names = [n for i in argnums for n in leaf_names(example_args[i], names[i])]
    input_names = [n for i in rest for n in leaf_names(example_args[i], names[i])]
    text = mark_arguments(text, [("param", n) for n in param_names]
                          + [("input", n) for n in input_names])
    return LoweredStep(text, tuple(param_names), tuple(input_names))


def mark_arguments(text: str, marks: Sequence[tuple[str, str]]) -> str:
    """``text`` with ``torchalpa.kind`` / ``torchalpa.name`` on each argument of ``@main``
    (kept beside the attributes it has), so the program names its parameters itself."""
    from jax._src.lib.mlir import ir

    from torchalpa.frontends.stablehlo import parse_module
    module, context = parse_module(text)
    with context:
        main = next(op.operation for op in module.body.operations
                    if op.operation.name == "func.func"
                    and str(op.operation.attributes["sym_name"]).strip('"') == "main")
        old = main.attributes["arg_attrs"] if "arg_attrs" in main.attributes else None
        dicts = []
        for i, (kind, name) in enumerate(marks):
            attrs = {}
            if old is not None:
                # jaxlib's mlir stubs declare no __getitem__ on attributes
                existing = ir.DictAttr(old[i])  # pyright: ignore[reportIndexIssue]
                attrs = {existing[j].name: existing[j].attr  # pyright: ignore[reportIndexIssue]
                         for j in range(len(existing))}
            attrs["torchalpa.kind"] = ir.StringAttr.get(kind)
            attrs["torchalpa.name"] = ir.StringAttr.get(name)
            dicts.append(ir.DictAttr.get(attrs))
        main.attributes["arg_attrs"] = ir.ArrayAttr.get(dicts)
        return str(module.operation.get_asm(enable_debug_info=True))
