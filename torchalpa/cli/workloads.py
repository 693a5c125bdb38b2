"""What the command line's arguments name: a model (a zoo family, ``suite:NAME``,
``module:callable`` or ``path/to/file.py:callable``) and a cluster (``h100:2x8``)."""

from __future__ import annotations

import importlib
from collections.abc import Callable

__all__ = ["parse_shape", "parse_cluster", "load_workload", "import_by_name", "zoo_module",
           "MODEL_HELP"]


def parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(s) for s in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise ValueError(f"a shape is positive integers joined by 'x' (e.g. 2x8), got {text!r}")
    return shape


def parse_cluster(spec: str, *, inter_node_gbps: float | None = None,
                  memory_gib: float | None = None):
    """``KIND:NODESxDEVICES`` -> ``Cluster.preset(KIND, NODES, DEVICES)`` for any GPU or
    machine ``gpu_specs.NODE_PRESETS`` names (``h100:2x8``, ``h200:4x8``, ``a100-80:1x8``,
    ``dgx-a100:2x8``; ``KIND`` alone: one node of the machine's GPUs); ``cpu:N`` ranks on
    this machine. ``inter_node_gbps`` (GB/s per device) and ``memory_gib`` (GiB per
    device) override the preset's."""
    import dataclasses

    from torchalpa.core import gpu_specs
    from torchalpa.core.cluster import Cluster
    for name, value in (("--inter-node-bandwidth", inter_node_gbps), ("--memory", memory_gib)):
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be a positive number, got {value}")
    kind, _, size = spec.partition(":")
    kind = kind.strip().lower()
    if kind == "cpu":
        (n,) = parse_shape(size or "1")[:1] or (1,)
        cluster = Cluster.local_cpu(n)
        if memory_gib is not None:
            cluster = dataclasses.replace(cluster, memory_per_device=memory_gib * 2 ** 30)
        return cluster
    shape = parse_shape(size) if size else None
    if shape is not None and len(shape) != 2:
        raise ValueError(f"the cluster size is NODESxDEVICES (e.g. h100:2x8), got {spec!r}")
    try:
        if shape is not None:       # said in the flag's terms, not Cluster.preset's
            held = gpu_specs.node_preset(kind).devices_per_node
            if shape[1] > held:
                raise ValueError(f"--cluster {spec}: a {kind} node holds {held} GPUs; use "
                                 f"{kind}:{shape[0]}xD with D from 1 to {held}")
        return Cluster.preset(
            kind, *(shape or ()),
            inter_node_bandwidth=None if inter_node_gbps is None else inter_node_gbps * 1e9,
            memory_per_device=None if memory_gib is None else memory_gib * 2 ** 30)
    except ValueError as e:
        if "unknown GPU or machine" in str(e):
            raise ValueError(f"unknown cluster kind {kind!r} in {spec!r}: {e}; or cpu:N") from None
        raise


def zoo_module():
    try:
        return importlib.import_module("torchalpa.models")
    except ImportError as e:
        raise SystemExit(f"torchalpa coverage: the model zoo (torchalpa.models) is not "
                         f"available ({e}); name models as module:callable instead") from e


MODEL_HELP = ("a tiny zoo family (llama, gpt, ...), a real size (llama3_8b, llama3_70b, "
              "llama3_405b, llama2_13b, gpt_39b, alpa_gpt_1.3b, alpa_moe_10b, ...), "
              "hf:MODEL_TYPE or hf:config.json "
              "(a transformers causal LM, random weights), suite:NAME, or module:callable")


def load_workload(spec: str, *, batch: int | None = None,
                  seq: int | None = None) -> Callable[[], tuple]:
    """``() -> (model, example_inputs, loss_fn)`` for ``spec`` (``MODEL_HELP``); ``batch``
    and ``seq`` change the batch and sequence of a zoo or HuggingFace model."""
    for name, value in (("--batch", batch), ("--seq", seq)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    if spec.startswith("hf:"):
        from torchalpa.models.hf import hf_causal_lm
        source = spec.partition(":")[2]
        return lambda: hf_causal_lm(source, batch_size=batch or 8, seq_len=seq)
    if ":" in spec:                               # suite:NAME, module:callable
        if batch is not None or seq is not None:
            raise ValueError(f"--batch and --seq change zoo and hf: models; {spec} makes its "
                             "own batch (change it there)")
        return _load_callable(spec)
    zoo = zoo_module()
    if spec in zoo.NAMED:
        return _unpack(lambda: zoo.named(spec, batch_size=batch, seq_len=seq), spec)
    if spec not in zoo.FAMILIES:
        raise ValueError(f"unknown model {spec!r}; tiny families {sorted(zoo.FAMILIES)}, real "
                         f"sizes {sorted(zoo.NAMED)}, hf:MODEL_TYPE, or module:callable")

    def tiny():
        w = zoo.tiny(spec, **({"batch_size": batch} if batch else {}))
        return w.replace(seq_len=seq) if seq else w
    return _unpack(tiny, spec)


def _load_callable(spec: str) -> Callable[[], tuple]:
    if spec.startswith("suite:"):
        from torchalpa.suite.cases import build_case
        name = spec.partition(":")[2]
        return lambda: build_case(name)
    module_name, _, attr = spec.rpartition(":")
    found = getattr(import_by_name(module_name, spec), attr, None)
    if found is None or not callable(found):
        raise ValueError(f"cannot load {spec!r}: {module_name} has no callable {attr!r}")
    return _unpack(found, spec)


def _unpack(make: Callable, spec: str) -> Callable[[], tuple]:
    """``make()`` (a Workload, or a ``(model, example_inputs, loss_fn)`` tuple) as a tuple."""
    def load():
        made = make()
        if hasattr(made, "build") and hasattr(made, "example_inputs"):
            return made.build(), made.example_inputs(), made.loss_fn
        import torch
        if not (isinstance(made, tuple) and len(made) == 3
                and isinstance(made[0], torch.nn.Module)
                and isinstance(made[1], (tuple, list))
                and (made[2] is None or callable(made[2]))):
            raise ValueError(f"{spec} returned {type(made).__name__} {str(made)[:60]!r}; it must "
                             "return a torchalpa.models.Workload or a tuple (model: nn.Module, "
                             "example_inputs: tuple of tensors, loss_fn or None)")
        return made
    return load


def import_by_name(module_name: str, spec: str):
    """A module by dotted name, or a ``.py`` file by path (``./train.py:make``).

    A dotted name is looked up first in the current folder, as ``python -m`` does: the
    ``torchalpa`` console script starts with its own folder on ``sys.path`` instead, so
    ``torchalpa coverage --model train:make`` would otherwise miss ``./train.py``. The
    current folder stays on the path, so the module's own imports find its neighbours."""
    import importlib.util
    import os
    import sys
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        if not os.path.isfile(module_name):
            raise ValueError(f"cannot load {spec!r}: no file {module_name}")
        name = os.path.splitext(os.path.basename(module_name))[0]
        file_spec = importlib.util.spec_from_file_location(name, module_name)
        if file_spec is None or file_spec.loader is None:
            raise ValueError(f"cannot load {spec!r}: {module_name} is not importable")
        module = importlib.util.module_from_spec(file_spec)
        file_spec.loader.exec_module(module)
        return module
    here = os.getcwd()
    if not any(os.path.abspath(entry or os.curdir) == here for entry in sys.path):
        sys.path.insert(0, here)
        importlib.invalidate_caches()
    try:
        return importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot load {spec!r}: {e} (looked in the current folder {here} and "
                         "on sys.path; give module:callable for a module importable from here, "
                         "or path/to/file.py:callable)") from e
