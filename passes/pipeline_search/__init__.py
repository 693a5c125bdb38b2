"""The inter-op pass: layers, Alpa's stage DP over submeshes, stage pricing and solving, the
pipeline's plan."""
