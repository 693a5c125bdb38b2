"""Errors that carry their figures: one message per front, and they survive pickling (a
rank's error sent to the others)."""

from __future__ import annotations

import pickle

from torchalpa.core.input_errors import BatchSplitError


def test_a_batch_split_error_names_the_value_and_the_apis_remedy():
    e = BatchSplitError("idx", 3, 8)
    assert isinstance(e, ValueError)
    assert str(e) == ("idx: the batch dim (3) must divide by 8 devices to split the batch as "
                      "asked (data parallel); use a batch that divides, or ShardParallel()")
    assert e.describe("use --method shard").endswith("(data parallel); use --method shard")


def test_a_batch_split_error_pickles_with_its_fields():
    e = pickle.loads(pickle.dumps(BatchSplitError("idx", 3, 8)))
    assert (e.value, e.batch, e.num_devices, str(e)) == \
        ("idx", 3, 8, str(BatchSplitError("idx", 3, 8)))
