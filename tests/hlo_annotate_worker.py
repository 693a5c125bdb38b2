"""Run by tests/test_hlo_annotate.py in a subprocess (XLA_FLAGS must precede jax): plan a
JAX MLP whose plan reshards between ops, annotate its StableHLO in both dialects, compile
each with XLA on 4 host devices and write the plan's and XLA's collectives as JSON."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.core.cluster import Cluster  # noqa: E402
from torchalpa.frontends.jax_lower import lower_jax  # noqa: E402
from torchalpa.interop.hlo_annotate import annotate_stablehlo  # noqa: E402
from torchalpa.interop.xla import compile_annotated, hlo_collectives  # noqa: E402


def loss(params, x, y):
    h = jnp.tanh(x @ params["w1"])                  # (B, 4d)
    h = jnp.tanh(h @ params["w2"])                  # (B, d)
    return jnp.mean((h @ params["w3"] - y) ** 2)


def main(out_path: str) -> None:
    rng = np.random.default_rng(0)
    shapes = {"w1": (64, 256), "w2": (256, 64), "w3": (64, 64)}
    params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in shapes.items()}
    x, y = (jnp.asarray(rng.normal(size=(8, 64)), jnp.float32) for _ in range(2))
    lowered = lower_jax(loss, (params, x, y))
    plan = torchalpa.plan(loss, (params, x, y),
                          cluster=Cluster.local_cpu(4).logical_mesh((4,)),
                          method=torchalpa.ShardParallel())
    report = {"plan": [{"kind": c.kind, "bytes": c.bytes, "phase": c.phase}
                       for c in plan.collectives],
              "intermediate_reshards": sum(1 for r in plan.reshards
                                           if any(s.is_collective for s in r.steps)
                                           and isinstance(r.slot, int))}
    for dialect in ("mhlo", "sdy"):
        annotated = annotate_stablehlo(lowered.text, plan, dialect=dialect,
                                       param_names=lowered.param_names,
                                       input_names=lowered.input_names)
        hlo = compile_annotated(annotated.text, plan, dialect=dialect)
        report[dialect] = {"constraints": annotated.constraints,
                           "skipped": annotated.skipped,
                           "xla": [{k: c[k] for k in ("kind", "bytes", "tensors")}
                                   for c in hlo_collectives(hlo)]}
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
