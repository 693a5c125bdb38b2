"""Generation speed: the zoo's GPT and Llama built with ``auto_parallel(mode="inference")``
on 1, 2 and 4 ranks, beside HuggingFace's ``generate()`` on one device and beside
``pm.unwrap()`` + ``generate()`` (every rank gathering the whole model and generating on
its own), from one run of this script.

    .venv/bin/python benchmarks/generate.py                     # both models, 1/2/4 ranks
    .venv/bin/python benchmarks/generate.py --models llama --nproc 1 2 --new 16

For each system: ``t(n)``, the median seconds of ``generate(max_new_tokens=n)`` over
``--repeats`` calls (greedy, ``--batch`` prompts of ``--prompt`` tokens), and ``t(1)``;
tokens/s is ``batch * n / t(n)`` (prefill included) and the time per token
``(t(n) - t(1)) / (n - 1)`` (one decode step for the whole batch). The HuggingFace side
runs the model's HuggingFace twin (``torchalpa/models/hf_twins.py``: the same weights,
the same logits; its tokens are checked equal to torchalpa's) with its own dynamic KV
cache. Each rank runs one thread (as torchrun gives it); on a 2-core machine 4 ranks
share 2 cores, so CPU figures there say more about overheads than about scaling. On a GPU
(one per rank, NCCL) the same script measures what serving does there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))

import torchalpa  # noqa: E402
from torchalpa.models import GPT, GPTConfig, Llama, LlamaConfig  # noqa: E402
from torchalpa.models.hf_twins import hf_twin  # noqa: E402


def build(kind: str, a) -> torch.nn.Module:
    torch.manual_seed(0)
    context = a.prompt + a.new
    if kind == "gpt":
        model = GPT(GPTConfig(vocab_size=a.vocab, max_seq_len=context, num_layers=a.layers,
                              num_heads=a.heads, hidden=a.hidden, dropout=0.0))
    else:
        model = Llama(LlamaConfig(vocab_size=a.vocab, max_seq_len=context, num_layers=a.layers,
                                  hidden=a.hidden, num_heads=a.heads,
                                  num_kv_heads=max(1, a.heads // 3), intermediate=a.hidden * 8 // 3))
    return model.eval()


def timed(generate, n: int, repeats: int) -> float:
    """Median seconds of ``generate(n)`` (after one untimed call)."""
    generate(n)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        generate(n)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def figures(generate, a) -> dict:
    t_n, t_1 = timed(generate, a.new, a.repeats), timed(generate, 1, a.repeats)
    return {"t_n": t_n, "t_1": t_1, "tokens_per_s": a.batch * a.new / t_n,
            "ms_per_token": (t_n - t_1) / (a.new - 1) * 1e3}


def worker(a) -> None:
    import torch.distributed as dist

    from torchalpa.runtime.execution.mesh import default_device, init_distributed
    init_distributed()
    device = default_device()
    results = {}
    for kind in a.models:
        model = build(kind, a)
        torch.manual_seed(1)
        ids = torch.randint(3, a.vocab, (a.batch, a.prompt))
        twin = hf_twin(model).eval().to(device)        # one device: before the model is split
        start = time.perf_counter()
        pm = torchalpa.auto_parallel(model, ids, mode=torchalpa.Inference(
            max_context=a.prompt + a.new))
        built = time.perf_counter() - start
        ours = figures(lambda n: pm.generate(ids, max_new_tokens=n), a)
        tokens = pm.generate(ids, max_new_tokens=a.new)
        record = {"ours": ours, "build_s": built, "mesh": list(pm.plan.mesh_shape),
                  "cache": sorted({str(t.placements) for t in pm.kv_cache().values()}),
                  "est_ms_per_token": pm.plan.estimates["token_latency_s"] * 1e3}
        hf_ids = ids.to(device)

        def hf(n, m=twin):
            return m.generate(hf_ids, max_new_tokens=n, do_sample=False, pad_token_id=0)

        record["same_tokens"] = bool(torch.equal(hf(a.new).cpu(), tokens))
        if dist.get_world_size() == 1:
            record["hf"] = figures(hf, a)
        else:
            start = time.perf_counter()
            plain = pm.unwrap()
            unwrap_s = time.perf_counter() - start
            gathered = hf_twin(plain).eval().to(device)
            record["unwrap"] = dict(figures(lambda n: hf(n, gathered), a), unwrap_s=unwrap_s)
        results[kind] = record
    if dist.get_rank() == 0:
        with open(a.worker, "w") as f:
            json.dump(results, f)
    dist.barrier()


def report(by_nproc: dict[int, dict], a) -> None:
    device = "GPU" if torch.cuda.is_available() else "CPU (gloo, one thread per rank)"
    print(f"\n{device}; batch {a.batch}, prompt {a.prompt}, {a.new} new tokens, greedy")
    for kind in a.models:
        hf = by_nproc.get(1, {}).get(kind, {}).get("hf")
        print(f"\n{kind}: hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}")
        print(f"{'system':<34}{'tokens/s':>10}{'ms/token':>10}{'vs HF 1 dev':>13}"
              f"{'vs unwrap':>11}  plan")
        if hf:
            print(f"{'HF generate(), one device':<34}{hf['tokens_per_s']:>10.1f}"
                  f"{hf['ms_per_token']:>10.2f}{'1.00x':>13}")
        for nproc, results in sorted(by_nproc.items()):
            r = results[kind]
            ours = r["ours"]
            vs_hf = f"{ours['tokens_per_s'] / hf['tokens_per_s']:.2f}x" if hf else "-"
            unwrap = r.get("unwrap")
            vs_unwrap = f"{ours['tokens_per_s'] / unwrap['tokens_per_s']:.2f}x" if unwrap else "-"
            print(f"{f'torchalpa, {nproc} rank(s)':<34}{ours['tokens_per_s']:>10.1f}"
                  f"{ours['ms_per_token']:>10.2f}{vs_hf:>13}{vs_unwrap:>11}  mesh "
                  f"{'x'.join(map(str, r['mesh']))}, cache {', '.join(r['cache'])}, "
                  f"est {r['est_ms_per_token']:.3g} ms/token, built in {r['build_s']:.1f}s, "
                  f"tokens {'equal' if r['same_tokens'] else 'DIFFER'}")
            if unwrap:
                print(f"{f'unwrap()+generate(), {nproc} ranks':<34}"
                      f"{unwrap['tokens_per_s']:>10.1f}{unwrap['ms_per_token']:>10.2f}"
                      f"{'':>24}  (+{unwrap['unwrap_s']:.2f}s to gather)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["gpt", "llama"], choices=["gpt", "llama"])
    p.add_argument("--nproc", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    from torchalpa.cli import bench
    flags = [f for k, v in vars(a).items() if k not in ("worker", "nproc")
             for f in ([f"--{k}", *map(str, v)] if isinstance(v, list) else [f"--{k}", str(v)])]
    by_nproc = {}
    for nproc in a.nproc:
        print(f"running on {nproc} rank(s)...", flush=True)
        by_nproc[nproc] = bench.launch(__file__, flags, nproc=nproc, quiet_netns=True)
    report(by_nproc, a)


if __name__ == "__main__":
    main()
