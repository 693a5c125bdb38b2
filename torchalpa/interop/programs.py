"""Training steps that are not torch modules: a JAX function or a StableHLO program.

``torchalpa.plan`` sends anything that is not an ``nn.Module`` here. A program is
- a JAX function ``fn(*example_args)`` returning the scalar loss (or ``(loss, grads)``);
  ``param_argnums`` says which arguments are parameters (pytrees welcome), or
- StableHLO text, or the path of a ``.mlir`` file holding it: ``@main`` takes the
  parameters first and returns ``(loss, *grads)`` (``frontends/stablehlo.py``);
  ``num_params`` says how many arguments are parameters when the text does not mark
  them (``torchalpa.export_stablehlo`` does).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from torchalpa.core.opgraph import OpGraph

__all__ = ["program_graph", "is_program", "read_program_text"]


def is_program(obj) -> bool:
    """Whether ``obj`` is a JAX function or StableHLO text/path rather than a torch model."""
    import torch
    return not isinstance(obj, torch.nn.Module) and (isinstance(obj, (str, os.PathLike))
                                                     or callable(obj))


def read_program_text(program: str | os.PathLike) -> str:
    """StableHLO text, given as text or as the path of a file holding it."""
    text = os.fspath(program)
    if "func.func" in text or "module" in text.split("\n", 1)[0]:
        return text
    if not os.path.exists(text):
        raise ValueError(f"{text[:80]!r} is neither StableHLO text nor a file; pass the text "
                         "(e.g. jax.jit(step).lower(*args).as_text()) or a .mlir path")
    with open(text) as f:
        return f.read()


def program_graph(program, example_args: Sequence | None = None, *, param_argnums=0,
                  num_params: int | None = None) -> OpGraph:
    """The OpGraph of a JAX step or a StableHLO program (see the module docstring)."""
    from torchalpa.frontends.stablehlo import from_stablehlo
    if isinstance(program, (str, os.PathLike)):
        if example_args:
            raise ValueError("a StableHLO program carries its own shapes; pass "
                             "example_inputs=() (or None) with it")
        return from_stablehlo(read_program_text(program), num_params=num_params)
    if not callable(program):
        raise TypeError(f"expected an nn.Module, a JAX function or StableHLO text, got "
                        f"{type(program).__name__}")
    try:
        import jax  # noqa: F401
    except ImportError as e:
        raise ImportError(f"{getattr(program, '__name__', program)!r} is not an nn.Module, so "
                          "torchalpa reads it as a JAX function, which needs jax: "
                          "pip install 'torchalpa[stablehlo]'") from e
    from torchalpa.frontends.jax_lower import lower_jax
    if example_args is None:
        raise ValueError("a JAX step needs example_args: the arguments it is called with")
    lowered = lower_jax(program, example_args, param_argnums)
    return from_stablehlo(lowered.text, param_names=lowered.param_names,
                          input_names=lowered.input_names)
