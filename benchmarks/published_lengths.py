"""llm-foundry's MPT runs at sequence lengths the table's rows do not take, estimated as
``published.py`` estimates its rows (their plans pinned): is a small model's miss tied
to attention (which grows with the sequence) or to every token?

    cd benchmarks && python published_lengths.py 125m-a100-s512 760m-h100-s512 760m-a100-s2048

Each case is a line of the same source's tables (``published_rows.FOUNDRY``: model,
GPUs, micro-batch, accumulation, tokens/s/GPU) with the row builder of ``published_rows``;
these are diagnostics beside the rows, not rows: nothing was tuned on them. The estimate
carries the trainer's per-micro-batch metrics as the rows do (``trainer_work``). Minutes
per case on the CPU VM.
"""

from __future__ import annotations

import sys

import published as P
from published_rows import _mpt

CASES = {   # name: (model, machine, micro-batch, accumulation, tokens/s/GPU, sequence)
    "125m-a100-s512": ("125m", "dgx-a100", 128, 2, 165681, 512),
    "125m-a100-s1024": ("125m", "dgx-a100", 64, 2, 156468, 1024),
    "760m-h100-s512": ("760m", "h100", 96, 2, 83749, 512),
    "760m-h100-s1024": ("760m", "h100", 48, 2, 78581, 1024),
    "760m-a100-s2048": ("760m", "dgx-a100", 24, 2, 32434, 2048),
}
"""llm-foundry's MPT tables (A100 80GB and H100 80GB BF16, 8 GPUs, FULL_SHARD, no
activation checkpointing), the lines of the held-out rows' models at other lengths or on
the other GPU."""


def main(names: list[str]) -> None:
    for name in names:
        size, machine, micro, accum, tokens, seq = CASES[name]
        row = _mpt(name, size, 8, machine, micro, accum, tokens, seq=seq)
        e = P.estimate(row)
        pub = row.published_step_s()
        print(f"{name:<18} published {pub:.3f} s  estimate {e.step_s:.3f} s  est/pub "
              f"{e.step_s / pub:.2f}  (compute {e.compute_s:.3f}, comm "
              f"{e.communication_s:.3f}, trainer metrics {e.trainer_s:.3f})", flush=True)


if __name__ == "__main__":
    unknown = [n for n in sys.argv[1:] if n not in CASES]
    if not sys.argv[1:] or unknown:
        sys.exit(f"cases: {', '.join(CASES)}")
    main(sys.argv[1:])
