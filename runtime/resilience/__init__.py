"""Resilience: failures that reach every rank, heartbeats, clean exits, replica checks."""
