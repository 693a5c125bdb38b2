"""Alpa's quickstart MLP written in JAX, planned by torchalpa, run by XLA on 4 CPU devices.

    python examples/jax_quickstart.py                       # 4 host devices, dim 256
    python examples/jax_quickstart.py --dim 512 --batch 512 --layers 4 --json out.json

torchalpa plans the step from its StableHLO (``torchalpa.plan(loss_fn, (params, x, y))``);
XLA then runs it with ``jax.jit`` whose in/out shardings (and the gradients' sharding
constraints) come from the plan, next to plain data parallelism (parameters replicated,
batch split). The script checks losses and parameters against one device, and sets the
collectives in XLA's compiled program beside the plan's list.
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

import jax                                          # noqa: E402
import jax.numpy as jnp                             # noqa: E402
import numpy as np                                  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec   # noqa: E402

import torchalpa                                    # noqa: E402
from torchalpa.xla import compare_collectives, shardings   # noqa: E402


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


def make_train_step(lr: float, grad_shardings=None):
    def train_step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        if grad_shardings is not None:               # gradients land where the plan puts them
            grads = jax.lax.with_sharding_constraint(grads, grad_shardings)
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

    # 3. the plan on NUM_DEVICES devices: jit with its shardings
    devices = np.array(jax.devices()[:NUM_DEVICES]).reshape(plan.mesh_shape)
    mesh = Mesh(devices, plan.axis_names)
    p_sh, x_sh, y_sh = shardings(plan, mesh, loss_fn, (params, x, y))
    replicated = NamedSharding(mesh, PartitionSpec())
    step = jax.jit(make_train_step(args.lr, p_sh), in_shardings=(p_sh, x_sh, y_sh),
                   out_shardings=(p_sh, replicated))
    compiled = step.lower(params, x, y).compile()
    placed = jax.device_put((params, x, y), (p_sh, x_sh, y_sh))
    new_params, losses = train(compiled, *placed, args.steps)

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
        "collectives": compare_collectives(plan, compiled.as_text()),
        "dp_collectives": compare_collectives(plan, dp_compiled.as_text()),
        "estimated_step_s": plan.estimates["step_time_s"],
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
