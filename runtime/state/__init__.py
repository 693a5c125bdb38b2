"""State in and out: crash-safe checkpoints, pretrained weights loaded into shards, trained
models saved.

- ``checkpoint``: ``save_checkpoint`` / ``load_checkpoint`` (DCP, versioned, checksummed,
  loadable into any plan or world size).
- ``extra_state``: a checkpoint's ``get_extra_state`` values, set before anything else.
- ``pretrained_load``: ``load_pretrained``, safetensors read straight into the shards.
- ``pretrained_save``: ``unwrap`` / ``save_pretrained``, the trained model gathered whole
  (a pipeline's stages included) as a plain module or a checkpoint.
"""
