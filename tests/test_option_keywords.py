"""A method given another option record's field says which record holds it and how to pass
it (``torchalpa/core/option_keywords.py``); a misspelt field gets the closest names."""

from __future__ import annotations

import dataclasses

import pytest

import torchalpa


@pytest.mark.parametrize("make, says", [
    (lambda: torchalpa.AutoParallel(memory_budget_per_device=2**30),
     r"AutoParallel\(auto_sharding_option=AutoShardingOption\(memory_budget_per_device=\.\.\.\)\)"),
    (lambda: torchalpa.ShardParallel(solver="cbc"),
     r"field of AutoShardingOption; pass ShardParallel\(auto_sharding_option="),
    (lambda: torchalpa.PipeshardParallel(layer_num=4),
     r"PipeshardParallel\(layer_option=AutoLayerOption\(layer_num=\.\.\.\)\)"),
    # a preset's own option record is the one to change, or its settings are lost
    (lambda: torchalpa.Zero3Parallel(remat="full"),
     r"dataclasses\.replace\(Zero3Parallel\(\)\.auto_sharding_option, remat=\.\.\.\)"),
    (lambda: torchalpa.AutoParallel(num_microbatches=4), r"did you mean num_micro_batches\?"),
])
def test_an_unknown_keyword_names_where_it_belongs(make, says):
    with pytest.raises(TypeError, match=says):
        make()


def test_known_keywords_replace_and_the_presets_settings_are_unchanged():
    method = torchalpa.AutoParallel(num_micro_batches=4, pipeline=False)
    assert (method.num_micro_batches, method.pipeline) == (4, False)
    assert dataclasses.replace(torchalpa.ShardParallel(), logical_mesh_shape=(2, 2)) \
        .logical_mesh_shape == (2, 2)
    assert torchalpa.Zero3Parallel().auto_sharding_option.rematerialize_parameters
