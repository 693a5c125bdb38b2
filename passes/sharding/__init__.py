"""The intra-op pass: strategies from rules, the cost graph, the ILP (and its presolve), and
the Plan assembled from its solution.

- ``intra_op``: the pass's entry, OpGraph + logical mesh + options -> Plan.
- ``view_floor``: a view's ILP refused by its memory floor (no plan fits), before it is
  built.
- ``strategies``: every legal placement of each op, derived from its factor rule.
- ``strides``: where a strided shard may travel (a dim cut into equal pieces).
- ``constraints``: layouts restricted as a method asks (batch dim, parameters, pins).
- ``reshard``: the one redistribution planner, layout -> collectives -> layout.
- ``shared_reshard``: one resharded copy of a value per target layout.
- ``costgraph``: the ILP's cost graph, vectors on nodes and matrices on edges.
- ``simplify``: followers share their operand's decision, repeated layers one decision.
- ``presolve``: exact reductions of the ILP before a solver sees it.
- ``ilp_model``: the ILP as plain arrays, built once for either solver.
- ``ilp``: Alpa's ILP, one strategy per node, solved by CBC (through PuLP) or HiGHS.
- ``ilp_highs``: the same arrays handed to HiGHS directly.
- ``plan_start``: a solved plan mapped back to its view's strategies, a solver's start.
- ``gradient_scatter``: Alpa's prefer_reduce_scatter, applied to a solved plan (gradients
  reduce-scattered, parameters stored split and gathered where first read).
- ``stage_boundary``: the batch-split layout two pipeline stages agree on for a value
  crossing between them.
- ``sharding_plan``: the Plan of a solution (reshards, collectives, estimates, notes).
- ``remat_choice``: activation checkpointing decided by planning with and without it.
- ``layer_remat``: how many blocks recompute, chosen by the memory they free.
"""
