"""Rewrites of lowered programs, each a pass of its own, applied in one place
(``program_rewrites``): overlap, gradient buckets, parameter gathers, fused kernels."""
