"""The planner's A/B switches (torchalpa/core/switches.py): defaults, blocks that change
some fields and restore them, and the values a forked search worker sees."""

from __future__ import annotations

import dataclasses

import pytest

from torchalpa.core.switches import PassSwitches, SearchSwitches
from torchalpa.passes.pipeline_search.stage_jobs import fork_map


def test_every_default_is_the_fast_path():
    """Every switch is on by default: a switch is a fast path kept for A/B, never a half-done
    one left off."""
    for record in (PassSwitches.current(), SearchSwitches.current()):
        fields = dataclasses.fields(record)
        assert fields and all(getattr(record, f.name) is True for f in fields)


def test_a_block_changes_only_what_it_names_and_restores_it():
    with PassSwitches.using(layer_classes=False) as outer:
        assert outer == PassSwitches.current()
        assert PassSwitches.current() == PassSwitches(layer_classes=False)
        with PassSwitches.using(copy_replicated=False):      # nested: both off
            assert PassSwitches.current() == PassSwitches(layer_classes=False,
                                                          copy_replicated=False)
            assert SearchSwitches.current() == SearchSwitches()  # another layer's record
        assert PassSwitches.current() == PassSwitches(layer_classes=False)
    assert PassSwitches.current() == PassSwitches()


def test_a_block_restores_the_values_on_an_error():
    with pytest.raises(RuntimeError), SearchSwitches.using(seed_sharing=False):
        assert not SearchSwitches.current().seed_sharing
        raise RuntimeError("in the block")
    assert SearchSwitches.current().seed_sharing


def test_a_switch_that_does_not_exist_or_a_record_changed_in_place_is_refused():
    with pytest.raises(TypeError, match="search_gap"), PassSwitches.using(search_gap=False):
        pass
    with pytest.raises(dataclasses.FrozenInstanceError):
        PassSwitches.current().direct_highs = False  # type: ignore[misc]


def _reuse_views(_: int) -> bool:
    return SearchSwitches.current().reuse_views


def test_a_forked_worker_sees_the_values_of_the_block_it_was_forked_in():
    """The layer ILPs and stage solves run in ``fork_map``'s workers: they must read the
    values the caller set (in one process when JAX is loaded: the same answer)."""
    with SearchSwitches.using(reuse_views=False):
        assert fork_map(_reuse_views, [0, 1, 2], workers=2) == [False] * 3
    assert fork_map(_reuse_views, [0, 1, 2], workers=2) == [True] * 3
