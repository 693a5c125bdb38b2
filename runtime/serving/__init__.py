"""Serving: a model's outputs without training, and generation with a static KV cache.

- ``inference``: forward-only programs of a training-wrapped model (``predict``, eval-mode
  losses).
- ``inference_module``: ``InferenceModule``, a causal LM parallelized for generation
  (``mode="inference"``).
- ``generate_loop``: the generation loop over the prefill and decode programs, as
  HuggingFace's ``generate`` runs it.
- ``sampling``: the next token from the logits (greedy, temperature, top-k, top-p).
"""
