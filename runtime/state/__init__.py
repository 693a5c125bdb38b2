"""State in and out: crash-safe checkpoints, pretrained weights loaded into shards, trained
models saved."""
