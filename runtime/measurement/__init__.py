"""Measurement: collectives counted and timed, step statistics, timelines, memory, profiles,
the DDP/FSDP baselines."""
