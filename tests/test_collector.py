"""``torchalpa.core.collector.collector_paused``: the garbage collector off inside, back
as it was after, whatever happens inside."""

from __future__ import annotations

import gc

import pytest

from torchalpa.core.collector import collector_paused


def test_the_collector_is_off_inside_and_on_after_nested_and_on_error():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():          # nested: the inner block leaves it off
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), collector_paused():
        raise KeyError("inside")
    assert gc.isenabled()


def test_a_collector_off_before_stays_off():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
