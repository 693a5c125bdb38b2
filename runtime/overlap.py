"""Overlap communication with computation in a local program.

A lowered program calls each collective of ``runtime.collectives`` as one blocking step.
This pass splits every such call into an *issue* (the functional collective, which the
process group runs in the background) and a *wait* placed right before the value's first
use. A gradient reduced at the end of backward is then summed across ranks while the
rest of backward computes -- the overlap DDP gets from its reducer -- and independent
collectives (all the gradients of ``reduce_grads``) are in flight together.

The collectives issued, their order and their bytes are unchanged (every rank issues
them in program order), so the plan's list still equals what runs.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from torchalpa.runtime import collectives as C

__all__ = ["overlap_collectives"]

_c10d = torch.ops._c10d_functional


# -- issue / finish halves of each collective (same layout math as runtime.collectives) --

def issue_all_reduce(x, reduce_op, group_name):
    return _c10d.all_reduce(x.contiguous(), reduce_op, group_name)


def finish_all_reduce(handle):
    return _c10d.wait_tensor(handle)


def issue_all_gather(x, dim, group_size, group_name):
    return _c10d.all_gather_into_tensor(x.contiguous(), group_size, group_name)


def finish_all_gather(handle, dim, group_size):
    out = _c10d.wait_tensor(handle)
    return out if dim == 0 else torch.cat(torch.chunk(out, group_size, dim=0), dim=dim)


def issue_reduce_scatter(x, dim, reduce_op, group_size, group_name):
    if dim != 0:
        x = torch.cat(torch.chunk(x, group_size, dim=dim), dim=0)
    return _c10d.reduce_scatter_tensor(x.contiguous(), reduce_op, group_size, group_name)


def finish_reduce_scatter(handle):
    return _c10d.wait_tensor(handle)


def issue_all_to_all(x, src_dim, dim, group_size, group_name):
    send = torch.cat(torch.chunk(x, group_size, dim=dim), dim=0).contiguous()
    splits = [send.shape[0] // group_size] * group_size
    return _c10d.all_to_all_single(send, splits, splits, group_name)


def finish_all_to_all(handle, src_dim, group_size):
    recv = _c10d.wait_tensor(handle)
    return torch.cat(torch.chunk(recv, group_size, dim=0), dim=src_dim)


# collective -> (issue, finish, which of its args the finish needs after the handle)
_SPLIT = {
    C.all_reduce: (issue_all_reduce, finish_all_reduce, ()),
    C.all_gather: (issue_all_gather, finish_all_gather, (1, 2)),
    C.reduce_scatter: (issue_reduce_scatter, finish_reduce_scatter, ()),
    C.all_to_all: (issue_all_to_all, finish_all_to_all, (1, 3)),
}


def overlap_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """Split blocking collective calls of ``gm`` into issue + late wait (in place)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    changed = False
    for node in list(graph.nodes):
        split = _SPLIT.get(node.target) if node.op == "call_function" else None
        if split is None or not node.users:
            continue
        issue_fn, finish_fn, kept = split
        with graph.inserting_before(node):
            issue = graph.call_function(issue_fn, node.args, node.kwargs)
        first_user = min(node.users, key=order.__getitem__)
        with graph.inserting_before(first_user):
            finish = graph.call_function(finish_fn, (issue, *[node.args[i] for i in kept]))
        node.replace_all_uses_with(finish)
        graph.erase_node(node)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm
