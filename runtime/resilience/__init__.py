"""Resilience: a failure on one rank reaches every rank as an error naming it, and a process
ends with its script's own exit status.

- ``faults``: failures that reach every rank (a rank that raises or stops, inputs that
  differ across ranks).
- ``rank_failure``: the error the other ranks raise, and the message naming who failed.
- ``heartbeat``: each rank's heartbeat thread, proof of life for its peers.
- ``rank_watchdog``: a small process that stops a rank stuck where no Python runs.
- ``launcher_stop``: under torchrun, a survivor names the rank that died before the
  agent's SIGTERM.
- ``replicas``: replicated values (and generator states) checked bitwise equal across ranks.
- ``clean_exit``: the script's exit status kept however it ends.
"""
