"""From a model to a plan or a parallel module: the public entry points and the one
orchestration every method goes through (capture, plan on rank 0, lower, distribute).

- ``api``: ``plan`` (no processes) and ``auto_parallel`` (under torchrun).
- ``build``: the one path from a model to a plan or a module, for every method and for
  ``mode="inference"``.
- ``workflow``: the public steps of that path (capture, same step on every rank, plan on
  rank 0).
- ``steps``: what the orchestration asks of a method (``MethodSteps`` and its kin).
- ``methods``: the tables of which implementation each method has for each kind of work.
- ``shard`` / ``pipeshard``: ShardParallel's and PipeshardParallel's steps.
- ``auto``: ``AutoParallel``, the planner choosing method, checkpointing and micro-batches.
- ``relaxed_bound``: a checkpointing candidate of ``auto`` bounded by its views' linear
  relaxations before its ILPs.
- ``dp_layout``: the experts' data-parallel layout (batch over every device, parameters
  sharded as ZeRO / FSDP place them), which ``auto`` weighs beside its intra-op plans.
- ``offload``: offloaded optimizer states priced, and the hosts' memory checked.
- ``states_floor``: a job whose model states alone fit neither the devices nor the hosts,
  refused from its parameters before anything is traced.
- ``fit_advice``: what would fit a job no plan fits (devices, memory per device), from
  the views' memory floors.
- ``tp_pins``: ``pin=`` in torch's tensor-parallel vocabulary.
- ``generation`` / ``cached_step``: generation's pieces, the LM with its static KV cache.
- ``cache``: plans cached on disk, keyed by everything that decides them.
- ``calibrate`` / ``calibrate_cuda`` / ``device_profile``: the machine measured, and the
  planner planning with what was measured.
- ``meta_model``: ``torchalpa.to_meta``, a model on the meta device with its ties kept.

Layers, data flow, and where to add things: docs/architecture.md.
"""
