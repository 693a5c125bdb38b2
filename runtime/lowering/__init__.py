"""Lowering: a Plan over the source graph -> this rank's local programs (per-node rewriting of
ATen calls for local blocks, the records of the programs)."""
