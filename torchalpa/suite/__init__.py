"""Models torchalpa was not written for, and what checks it on them: the model suite
(``cases``: HuggingFace, torchvision and hand-written models, each called as its own
documentation calls it; ``torchalpa coverage --hf`` and tests/test_suite.py run it),
the transformers shrinker (``hf_shrink``: a tiny config of any HuggingFace model) and
the HuggingFace twins of the zoo's decoders (``hf_twins``: the same weights in
transformers, to compare generation with).

Kept apart from the zoo (``torchalpa.models``: models to plan and train) as fixtures;
imports only the zoo, ops and core. Layers: docs/architecture.md.
"""
