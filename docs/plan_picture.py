"""Make docs/plan.png, the README's picture of ``plan.to_html``: a 4-layer GPT pipelined in
two stages over one node of 8 H100s (2 x 4 devices per stage, planned, not run), rendered
by headless Chromium (``apt-get install -y chromium``) and stored with a 64-colour palette.

    .venv/bin/python docs/plan_picture.py [--out docs/plan.png] [--width 1000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

import torchalpa
from torchalpa import models as zoo

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from headless import page_layout, screenshot  # noqa: E402


def pipeline_plan():
    workload = zoo.tiny("gpt", batch_size=8, num_layers=4, hidden=256, num_heads=4,
                        max_seq_len=64)
    with torch.device("meta"):
        model, inputs = workload.build(), workload.example_inputs()
    method = torchalpa.PipeshardParallel(
        num_micro_batches=4, pipeline_schedule="1f1b",
        layer_option=torchalpa.AutoLayerOption(layer_num=4),
        stage_option=torchalpa.ManualStageOption(
            forward_stage_layer_ids=((0, 1), (2, 3)), submesh_shapes=((1, 4), (1, 4)),
            logical_shapes=((2, 2), (2, 2))))
    return torchalpa.plan(model, inputs, workload.loss_fn, method=method,
                          cluster=torchalpa.Cluster.h100(num_nodes=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("plan.png"))
    parser.add_argument("--width", type=int, default=1000)
    args = parser.parse_args()
    from PIL import Image
    with tempfile.TemporaryDirectory() as tmp:
        page, png = Path(tmp) / "plan.html", Path(tmp) / "plan.png"
        pipeline_plan().to_html(page)
        height = page_layout(page, {}, width=args.width)["height"]
        screenshot(page, png, width=args.width, height=height)
        Image.open(png).convert("RGB").quantize(64).save(args.out, optimize=True)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB, {args.width}x{height})")


if __name__ == "__main__":
    main()
