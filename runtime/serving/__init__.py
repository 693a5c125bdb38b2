"""Serving: generation with a static KV cache, sampling, forward-only programs."""
