"""Alpa's quickstart MLP written in JAX, planned by torchalpa, run by XLA on 4 CPU devices.

    python examples/jax_quickstart.py                       # 4 host devices, dim 256
    python examples/jax_quickstart.py --dim 512 --batch 512 --layers 4 --json out.json

torchalpa plans the step from its StableHLO (``torchalpa.plan(loss_fn, (params, x, y))``).
The same StableHLO is annotated with the plan (``annotate_stablehlo``: argument and
gradient shardings, and a sharding constraint at every point where the plan reshards a
value between two ops), and XLA's SPMD partitioner compiles it for 4 CPU devices, so the
program XLA runs is the plan's layouts, not XLA's own propagation from the arguments. The
SGD update is a ``jax.jit`` with the parameters' shardings. Plain data parallelism
(parameters replicated, batch split) runs beside it. The script checks losses and
parameters against one device, and sets the collectives in XLA's compiled program beside
the plan's list.
"""

import argparse
import json
import os
import sys

NUM_DEVICES = int(os.environ.get("TORCHALPA_XLA_DEVICES", "4"))
if "jax" in sys.modules:
    raise RuntimeError("import this example before jax: XLA_FLAGS must be set first")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_force_host_platform_device_count={NUM_DEVICES}")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import torchalpa  # noqa: E402
from torchalpa.frontends.jax_lower import lower_jax  # noqa: E402
from torchalpa.interop.hlo_annotate import annotate_stablehlo, load_annotated  # noqa: E402
from torchalpa.interop.xla import compare_collectives, shardings  # noqa: E402


def init_params(dim: int, num_layers: int, seed: int):
    """Alpa's MLP: d -> 4d on even layers, 4d -> d on odd ones, a ReLU after each."""
    rng = np.random.default_rng(seed)
    layers = []
    for i in range(num_layers):
        d_in, d_out = (dim, 4 * dim) if i % 2 == 0 else (4 * dim, dim)
        layers.append({"w": jnp.asarray(rng.normal(0, d_in ** -0.5, (d_in, d_out)), jnp.float32),
                       "b": jnp.zeros((d_out,), jnp.float32)})
    return {"layers": layers}


def loss_fn(params, x, y):
    h = x                                            # (B, d)
    for layer in params["layers"]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])  # (B, 4d) or (B, d)
    return jnp.mean((h - y) ** 2)


def make_train_step(lr: float):
    def train_step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, grads)
        return params, loss
    return train_step


def train(step, params, x, y, num_steps):
    losses = []
    for _ in range(num_steps):
        params, loss = step(params, x, y)
        losses.append(float(loss))
    return params, losses


def max_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(p - q))) for p, q in
               zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def run(args) -> dict:
    params = init_params(args.dim, args.layers, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    out_dim = 4 * args.dim if args.layers % 2 else args.dim
    x = jnp.asarray(rng.normal(size=(args.batch, args.dim)), jnp.float32)   # (B, d)
    y = jnp.asarray(rng.normal(size=(args.batch, out_dim)), jnp.float32)    # (B, d_out)

    # 1. plan the step from its StableHLO, for this machine's devices
    cluster = torchalpa.Cluster.local_cpu(NUM_DEVICES)
    plan = torchalpa.plan(loss_fn, (params, x, y), cluster=cluster)
    print(plan.summary())

    # 2. one device: the reference
    ref_params, ref_losses = train(jax.jit(make_train_step(args.lr)), params, x, y, args.steps)

    # 3. the plan on NUM_DEVICES devices: its annotated StableHLO, compiled by XLA
    devices = np.array(jax.devices()[:NUM_DEVICES]).reshape(plan.mesh_shape)
    mesh = Mesh(devices, plan.axis_names)
    lowered = lower_jax(loss_fn, (params, x, y))     # the program the plan was made from
    annotated = annotate_stablehlo(lowered.text, plan, param_names=lowered.param_names,
                                   input_names=lowered.input_names)
    print(f"\nsharding constraints between ops: {len(annotated.constraints)}"
          + (f" (left to XLA: {annotated.skipped})" if annotated.skipped else ""))
    loss_and_grads, hlo = load_annotated(annotated.text, plan, mesh,
                                         lowered.param_names + lowered.input_names)
    p_sh, x_sh, y_sh = shardings(plan, mesh, loss_fn, (params, x, y))
    sgd = jax.jit(lambda p, g: jax.tree_util.tree_map(lambda a, b: a - args.lr * b, p, g),
                  in_shardings=(p_sh, p_sh), out_shardings=p_sh)
    new_params, losses = jax.device_put(params, p_sh), []
    tree = jax.tree_util.tree_structure(params)
    for _ in range(args.steps):
        loss, *grads = loss_and_grads(*jax.tree_util.tree_leaves(new_params), x, y)
        new_params = sgd(new_params, jax.tree_util.tree_unflatten(tree, grads))
        losses.append(float(loss))

    # 4. plain data parallelism beside it: parameters replicated, the batch split
    dp_mesh = Mesh(np.array(jax.devices()[:NUM_DEVICES]), ("dp",))
    dp_rep = NamedSharding(dp_mesh, PartitionSpec())
    dp_batch = NamedSharding(dp_mesh, PartitionSpec("dp"))
    dp_step = jax.jit(make_train_step(args.lr), in_shardings=(dp_rep, dp_batch, dp_batch),
                      out_shardings=(dp_rep, dp_rep))
    dp_compiled = dp_step.lower(params, x, y).compile()
    dp_params, dp_losses = train(dp_compiled, *jax.device_put((params, x, y),
                                                              (dp_rep, dp_batch, dp_batch)),
                                 args.steps)

    report = {
        "mesh": dict(zip(plan.axis_names, plan.mesh_shape)),
        "placements": {p.name: [str(q) for q in p.placements] for p in plan.parameters},
        "losses": losses, "reference_losses": ref_losses, "dp_losses": dp_losses,
        "max_param_diff": max_diff(new_params, ref_params),
        "dp_max_param_diff": max_diff(dp_params, ref_params),
        "constraints": annotated.constraints, "skipped": annotated.skipped,
        "plan_collectives": [{"kind": c.kind, "bytes": c.bytes, "phase": c.phase,
                              "tensor": c.tensor} for c in plan.collectives],
        "collectives": compare_collectives(plan, hlo),
        "dp_collectives": compare_collectives(plan, dp_compiled.as_text()),
        "estimated_step_s": plan.estimates.step_time_s,
    }
    print(f"\nlosses (torchalpa on XLA): {[round(v, 5) for v in losses]}")
    print(f"losses (one device):       {[round(v, 5) for v in ref_losses]}")
    print(f"largest parameter difference after {args.steps} steps: "
          f"{report['max_param_diff']:.2e} (data parallel: {report['dp_max_param_diff']:.2e})")
    print("\ncollectives per step: plan vs XLA's compiled program (torchalpa's shardings)")
    print(f"  {'kind':16s}{'plan':>6s}{'plan bytes':>12s}{'xla ops':>9s}{'tensors':>9s}"
          f"{'xla bytes':>11s}")
    for kind, row in sorted(report["collectives"].items()):
        print(f"  {kind:16s}{row['plan_count']:6d}{row['plan_bytes']:12d}{row['xla_ops']:9d}"
              f"{row['xla_tensors']:9d}{row['xla_bytes']:11d}")
    plan_total = sum(r["plan_bytes"] for r in report["collectives"].values())
    xla_total = sum(r["xla_bytes"] for r in report["collectives"].values())
    dp_total = sum(r["xla_bytes"] for r in report["dp_collectives"].values())
    print(f"  {'total bytes':16s}{plan_total:18d}{xla_total:29d}   (data parallel: {dp_total})")
    return report


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    report = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    ok = report["max_param_diff"] < 1e-4 and np.allclose(report["losses"],
                                                         report["reference_losses"], rtol=1e-4)
    print("\nmatches one device" if ok else "\nDIFFERS from one device")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
