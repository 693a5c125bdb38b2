"""Models torchalpa was not written for, and what checks it on them.

- ``cases``: the model suite: HuggingFace, torchvision and hand-written models, each
  called as its own documentation calls it (``torchalpa coverage --hf`` and
  tests/test_suite.py run it).
- ``hf_shrink``: the transformers shrinker, a tiny config of any HuggingFace model.
- ``hf_twins``: the HuggingFace twins of the zoo's decoders (the same weights in
  transformers, to compare generation with).

Kept apart from the zoo (``torchalpa.models``: models to plan and train) as fixtures;
imports only the zoo, ops and core. Layers: docs/architecture.md.
"""
