"""The inter-op pass: layers, Alpa's stage DP over submeshes, stage pricing and solving, the
pipeline's plan.

- ``inter_op``: the pass's entry (PipeshardParallel): layers -> stages on submeshes -> plans.
- ``layers``: layers, the contiguous groups of ops stages are made of.
- ``layer_bound``: a searched pipeline's bound by its layers' own plans, read before any
  stage ILP.
- ``layer_costs``: per-layer estimates, each distinct layer planned on every searched view.
- ``layer_cache``: structural keys of layers and stages, and a cache of their solves.
- ``stage_search``: the search, Alpa's stage DP with the deciding stages priced exactly.
- ``stages``: the dynamic program itself, layers -> stages -> submeshes.
- ``search_problem``: what the search plans, and what follows from it once.
- ``search_keys``: the search's records (a stage candidate, how it is planned, its key).
- ``shape_bound``: a pipeline shape's lower bound by its stages, before any layer is solved.
- ``stage_costs``: additive stage estimates from the layers' plans.
- ``exact_stages``: exact stage prices, a range of layers planned by its own ILP.
- ``given_stages``: stages given instead of searched (by hand, or uniform).
- ``stage_solve``: one stage's intra-op solve, what it is solved from and how hard.
- ``stage_jobs``: the search's workers, independent solves in forked processes.
- ``stage_recompute``: what a stage that checkpoints its activations costs.
- ``stage_transfers``: what crosses between stages, and how often.
- ``subgraph``: a stage's own graph, forward and backward of its layers.
- ``submesh_views``: the logical views a submesh is planned as.
- ``view_classes``: views that shard the same dims, and pricing one view's plan on another.
- ``transplant``: a stage's plan moved onto identical layers elsewhere in the model.
- ``pricing_memo``: pure pricing work kept across the many graphs planned on one view.
- ``pipeline_assembly``: the PipelinePlan of the chosen stages, each planned exactly,
  placed on ranks and timed by its schedule.
"""
