"""Each micro-batch count's step as the search makes it (``MicroBatchSteps``: traced, or
derived once a derivation matched a trace) against a fresh trace of that count: which
counts were traced, which derived, and whether each derived step is the traced one.

    OMP_NUM_THREADS=1 python benchmarks/rebatch_vs_trace.py llama3_70b 2 128 1,2,4,8,16

(zoo model, layers, batch size, micro-batch counts); bf16 mixed precision, meta weights.
"""
import sys

import torch

import torchalpa
import torchalpa.frontends.rebatch as rebatch
import torchalpa.models as zoo
from torchalpa.parallel.workflow import capture_examples, capture_step, with_precision

name, layers, bs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
counts = [int(x) for x in sys.argv[4].split(",")]
w = zoo.NAMED[name](batch_size=bs).replace(num_layers=layers)
with torch.device("meta"):
    model = with_precision(w.build(), torchalpa.MixedPrecision(param_dtype=torch.bfloat16))
batch = w.example_inputs(device="meta")
traces = []


def trace(k):
    return capture_step(model, capture_examples(model, batch, k), w.loss_fn)


steps = rebatch.MicroBatchSteps(lambda k: traces.append(k) or trace(k))
for k in counts:
    steps(k)
print(f"{name} {layers} layers batch {bs}: traced {traces}, checked {steps.checked}, "
      f"derived {sorted(steps.derived)}")
for k in sorted(steps.derived):
    print(f"  k={k}: derived is the traced step: {rebatch.same_step(steps(k), trace(k))}, "
          f"fingerprint {steps(k).graph.fingerprint()[:12]}")
