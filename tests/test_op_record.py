"""Recording a step's ops on meta tensors (frontends/op_record.py): op arguments flatten to
the leaves pytree gives, by the direct walk for plain containers and by pytree for others."""

from __future__ import annotations

import collections

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from torchalpa.frontends.op_record import flat_leaves


def test_op_arguments_flatten_as_pytree_flattens_them():
    graph = fx.Graph()
    node = graph.placeholder("x")
    pair = collections.namedtuple("pair", "a b")
    t = torch.empty(2, 3, device="meta")
    trees = [
        ((t, [1, 2.5, None], {"dim": -1, "keepdim": True}), {"dtype": torch.bfloat16}),
        (t.shape, [torch.Size([4, 5]), (torch.device("meta"), torch.strided)]),
        (pair(t, 3), [pair([t, t], {"k": (1, 2)})], True, "mean", 2j),
        (fx.immutable_collections.immutable_list([node, 1]),
         fx.immutable_collections.immutable_dict({"out": node})),
        ((), [], {}, torch.contiguous_format),
    ]
    for tree in trees:
        assert flat_leaves(tree) == tree_flatten(tree)[0], tree
