"""Frontends: turn a training step written in a framework into an OpGraph."""
