"""What torchalpa costs when there is nothing to parallelize: one rank, step time next to
plain eager PyTorch on the same model, batch and optimizer.

    python benchmarks/one_rank_overhead.py                 # both sizes below
    python benchmarks/one_rank_overhead.py --sizes 1024x1024x10 --steps 10

Each size is ``dim x batch x layers`` of Alpa's quickstart MLP (d -> 4d -> d, ReLU, MSE,
Adam), or ``gpt:layers:batch`` for the zoo's GPT at GPT-2-small width (hidden 768, 12
heads, seq 256, vocab 50257, dropout off) with ``layers`` blocks, or ``zoo:family:batch``
for a zoo model's tiny config (``zoo:vit:16``: what the 4-rank zoo benchmark trains). Eager and torchalpa
steps alternate (one of each per round) so drifting machine load hits both alike; the
figure is the median over rounds. One thread, as torchrun gives each rank. torchalpa runs
three ways: ``train_step`` (no autograd), ``loss.backward()`` (the autograd path), and
``train_step`` under ``torch.compile`` (if ``--compile``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

from quickstart import MLP  # noqa: E402

import torchalpa  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="*", default=["1024x512x4", "256x64x8", "gpt:2:4"],
                   help="dim x batch x layers, or gpt:layers:batch")
    p.add_argument("--steps", type=int, default=15, help="timed rounds per size")
    p.add_argument("--compile", action="store_true", help="also time compile=True")
    p.add_argument("--check", action="store_true",
                   help="exit 1 if train_step is slower than 1.10x eager on the first size")
    return p.parse_args()


def eager_step(model, opt, loss_fn, x, y):
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x), y)
    loss.backward()
    opt.step()
    return loss


def autograd_step(pm, opt, x, y):
    opt.zero_grad(set_to_none=True)
    loss = pm(x, y)
    loss.backward()
    opt.step()
    return loss


def workload(size: str):
    """(make_model, (x, y), loss_fn) for a size string."""
    if size.startswith("zoo:"):           # zoo:<family>:<batch>, the tiny config (dropout off)
        from torchalpa import models
        _, family, batch = size.split(":")
        w = models.tiny(family, batch_size=int(batch),
                        **({"dropout": 0.0} if family in ("gpt", "bert") else {}))
        batch = w.example_inputs()
        if len(batch) != 2:
            raise SystemExit(f"{size}: this benchmark times (input, target) batches; "
                             f"{family}'s has {len(batch)} tensors (use vit, gpt, llama...)")
        return w.build, batch, w.loss_fn
    if size.startswith("gpt:"):
        from torchalpa.models import GPT, GPTConfig, lm_loss
        _, layers, batch = size.split(":")
        config = GPTConfig(vocab_size=50257, max_seq_len=256, num_layers=int(layers),
                           num_heads=12, hidden=768, dropout=0.0)
        tokens = torch.randint(config.vocab_size, (int(batch), 257))
        return (lambda: GPT(config)), (tokens[:, :-1].contiguous(),
                                      tokens[:, 1:].contiguous()), lm_loss
    dim, batch, layers = (int(v) for v in size.split("x"))
    return (lambda: MLP(dim, layers)), (torch.randn(batch, dim), torch.randn(batch, dim)), \
        F.mse_loss


def measure(size: str, steps: int, compile: bool) -> dict:
    make, (x, y), loss_fn = workload(size)
    adam = lambda ps: torch.optim.Adam(ps, lr=1e-4)  # noqa: E731
    torch.manual_seed(0)
    eager = make()
    eager_opt = adam(eager.parameters())
    runs = {"eager": lambda: eager_step(eager, eager_opt, loss_fn, x, y)}
    torch.manual_seed(0)
    pm = torchalpa.auto_parallel(make(), (x, y), loss_fn, optimizer=adam)
    runs["train_step"] = lambda: pm.train_step(x, y)
    torch.manual_seed(0)
    pm_ag = torchalpa.auto_parallel(make(), (x, y), loss_fn, optimizer=adam)
    runs["loss.backward()"] = lambda: autograd_step(pm_ag, pm_ag.optimizer, x, y)
    if compile:
        torch.manual_seed(0)
        pm_c = torchalpa.auto_parallel(make(), (x, y), loss_fn, optimizer=adam, compile=True)
        runs["train_step, compiled"] = lambda: pm_c.train_step(x, y)
    times = {k: [] for k in runs}
    for _ in range(2):                     # warm-up (and compilation)
        for run in runs.values():
            run()
    for _ in range(steps):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main():
    args = parse_args()
    torch.set_num_threads(1)
    print(f"one rank, 1 thread, Adam; median of {args.steps} alternating rounds")
    first = None
    for size in args.sizes:
        t = measure(size, args.steps, args.compile)
        first = first or t
        what = (f"GPT, {size.split(':')[1]} layers, batch {size.split(':')[2]}, seq 256"
                if size.startswith("gpt:") else
                f"zoo {size.split(':')[1]} (tiny), batch {size.split(':')[2]}"
                if size.startswith("zoo:") else f"quickstart MLP {size} (dim x batch x layers)")
        print(f"\n{what}")
        for name, s in t.items():
            ratio = "" if name == "eager" else f"  ({s / t['eager']:.3f}x eager)"
            print(f"  {name:<22} {s * 1e3:9.2f} ms{ratio}")
    if args.check and first["train_step"] > 1.10 * first["eager"]:
        print("FAIL: train_step is more than 1.10x eager")
        sys.exit(1)


if __name__ == "__main__":
    main()
