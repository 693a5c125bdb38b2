"""Lowering: a Plan over the source graph -> this rank's local programs (fx graphs of local
ops and collectives), and the run-time pieces those programs call.

- ``lower``: the one lowering, from a Plan to this rank's forward, backward and
  gradient-reduction programs.
- ``local_graph``: a slice of the source graph as this rank's joint graph, node by node.
- ``localize``: one ATen call of the global program rewritten for this rank's blocks.
- ``rank_programs``: the records of one rank's programs, as lowered and as a step runs them.
- ``device_ops``: ops that run only on some device types, and the check for foreign ones.
- ``random_draws``: random ops at run time (one draw per block, replicas alike).
- ``synced``: ops that split a dim their results depend on, in phases joined by all-reduces.
- ``sync_norm``: training batch norm over a batch split across devices.
- ``vocab``: vocabulary-parallel embedding lookups.
- ``strided_dtensor``: redistributing and gathering DTensors held as strided shards.
"""
