"""Host work per training step: torchalpa on one rank against eager PyTorch, on tiny zoo
models whose kernels take next to nothing, so what is timed is Python and dispatch.

    python benchmarks/host_overhead.py                  # bert, gpt, vit; fp32 and bf16
    python benchmarks/host_overhead.py --models bert --repeats 3

On a GPU a step whose kernels are short waits for the host: the H200 run of 2026-11-28
measured bf16 BERT-base at 1.58x eager's step with the same plan, and this benchmark
shows where such a gap comes from on any machine. Each variant (eager; eager under
``torch.autocast`` for bf16; ``auto_parallel`` with and without
``MixedPrecision(param_dtype=torch.bfloat16)``) steps ``--steps`` times after a warm-up,
the variants alternating ``--repeats`` times in one process; the best median of each is
printed with torchalpa / eager. One thread, AdamW.
"""

from __future__ import annotations

import torch
from _common import benchmark_process, median_time, parser

import torchalpa
import torchalpa.models as zoo

CONFIGS = {
    "bert": (dict(vocab_size=512, max_seq_len=16, num_layers=12, hidden=64, num_heads=4,
                  intermediate=128, dropout=0.0), 16),
    "gpt": (dict(vocab_size=512, max_seq_len=16, num_layers=12, num_heads=4, hidden=64,
                 dropout=0.0), 16),
    "vit": (dict(image_size=32, patch_size=16, num_layers=12, hidden=64, num_heads=4,
                 num_classes=10, dropout=0.0), None),
}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def eager_step(w, batch, bf16: bool):
    model = w.build()
    opt = adamw(model.parameters())

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = w.loss_fn(model(*batch[:-1]), batch[-1])
        loss.backward()
        opt.step()
    return step


def torchalpa_step(w, batch, bf16: bool):
    precision = torchalpa.MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
    pm = torchalpa.auto_parallel(w.build(), batch, w.loss_fn, optimizer=adamw,
                                 mixed_precision=precision)
    return lambda: pm.train_step(*batch)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--models", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    with benchmark_process():
        measure(args)


def measure(args) -> None:
    print(f"PyTorch {torch.__version__}; best of {args.repeats} medians of {args.steps} steps, "
          "one thread")
    print(f"{'model':<6}{'dtype':<6}{'eager ms':>10}{'torchalpa ms':>14}{'ratio':>8}")
    for name in args.models:
        config, seq = CONFIGS[name]
        w = zoo.Workload(name, zoo.FAMILIES[name].tiny_config(**config), 2, seq)
        torch.manual_seed(0)
        batch = w.example_inputs()
        for bf16 in (False, True):
            steps = {"eager": eager_step(w, batch, bf16), "torchalpa": torchalpa_step(w, batch, bf16)}
            for step in steps.values():
                for _ in range(3):
                    step()
            best = dict.fromkeys(steps, float("inf"))
            for _ in range(args.repeats):
                for k, s in steps.items():
                    best[k] = min(best[k], median_time(s, args.steps))
            print(f"{name:<6}{'bf16' if bf16 else 'fp32':<6}{best['eager'] * 1e3:10.2f}"
                  f"{best['torchalpa'] * 1e3:14.2f}{best['torchalpa'] / best['eager']:8.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
