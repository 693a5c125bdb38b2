"""torchalpa's placements are DTensor's own classes; plan JSON keeps its text forms."""

import pytest
from torch.distributed import tensor as dt

import torchalpa
from torchalpa.core.placement import format_placements, parse_placement, parse_placements, short


def test_exports_are_torch_classes():
    assert torchalpa.Shard is dt.Shard
    assert torchalpa.Replicate is dt.Replicate
    assert torchalpa.Partial is dt.Partial


def test_text_forms_round_trip():
    layout = (dt.Shard(1), dt.Replicate(), dt.Partial("avg"))
    assert format_placements(layout) == ["Shard(1)", "Replicate()", "Partial(avg)"]
    assert short(layout) == "S(1)RP(avg)"
    assert parse_placements(format_placements(layout)) == layout
    # torch's own repr, and the short forms, read back too
    assert parse_placement(repr(dt.Shard(0))) == dt.Shard(0)
    assert parse_placement("P") == dt.Partial("sum")
    assert parse_placement("Partial(sum)") == dt.Partial()


def test_unsupported_partial_is_named():
    with pytest.raises(ValueError, match="sum.*avg.*max.*min"):
        parse_placement("Partial(product)")
    # a max or min over a split dim (amax/amin) is a Partial the plan JSON holds
    assert parse_placement("Partial(max)") == dt.Partial("max")
    assert short((dt.Partial("min"),)) == "P(min)"
    # ... which no value is pinned to: it only arises inside a step
    with pytest.raises(ValueError, match="Partial max or min only arises inside a step"):
        torchalpa.AutoShardingOption(pin={"w": (dt.Partial("max"),)})


def test_pins_accept_torch_placements():
    option = torchalpa.AutoShardingOption(pin={"w": (dt.Replicate(), dt.Shard(0))})
    assert option.pin == (("w", ("R", "S(0)")),)
