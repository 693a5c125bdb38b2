"""Pricing: what ops, collectives and memory cost (alpha-beta collectives, the compute
roofline, kernel effects, liveness memory, lower bounds)."""
