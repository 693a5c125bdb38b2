"""Gradient buckets packed into flat buffers kept from step to step, as DDP keeps its buckets.

A bucket's members are concatenated into one flat buffer, all-reduced in place and cut
back into views that become the gradients (``runtime.rewrites.buckets``). Made with
``torch.cat`` each step, that buffer is a fresh allocation: on CPU, one over glibc's mmap
threshold is mapped anew and its every page faults on first write (1,070-1,600 faults a
step for the 64-layer MLP of ``benchmarks/loop_vs_ddp.py``, none for DDP). DDP allocates
its buckets once.

``keep_bucket_buffers(gm)`` rewrites a program that runs eagerly (the copies
``runtime.rewrites.program_rewrites.step_programs`` makes, never the programs
``torch.compile`` traces or ``local_program()`` prints): each ``flatten_concat`` of a
bucket becomes a call of a ``KeptBucket`` of its own, which concatenates into a buffer it
keeps (``torch.cat(..., out=)``: the same values, bit for bit).

The gradients a step returns are views of that buffer, and a user may keep them (``g =
p.grad``), or keep ``p.grad`` itself across steps (``zero_grad(set_to_none=False)``, or
gradients accumulated over several backward calls). So a buffer is reused only when
nothing outside its ``KeptBucket`` holds its storage (``torch._C._storage_Use_Count``:
no view of it is alive); else the step packs into another buffer, kept as well (at most
``MAX_KEPT`` per bucket; beyond that, a fresh one each step, as before). In the README's
loop (``opt.zero_grad()`` sets the gradients to None) one buffer per bucket serves every
step; with ``set_to_none=False`` the gradients stay views of the first buffer and the
steps alternate on a second. A step that raised while its bucket's all-reduce was in
flight may leave that collective writing into the buffer; the next step packs into it
anyway (the failed step's gradients are not used).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from torchalpa.runtime.rewrites.buckets import BUCKET, flatten_concat

__all__ = ["KeptBucket", "keep_bucket_buffers", "MAX_KEPT"]

MAX_KEPT = 2          # buffers kept per bucket (module doc: why two serve every loop)


def _unshared(buf: torch.Tensor) -> bool:
    """Whether no tensor but ``buf`` holds ``buf``'s storage (the storage object made to
    ask holds one more reference)."""
    return torch._C._storage_Use_Count(buf.untyped_storage()._cdata) <= 2


class KeptBucket:
    """``flatten_concat`` into buffers this bucket keeps between steps (module doc)."""

    def __init__(self, index: int):
        # FX prints a call of this object by its name (one global per object)
        self.__name__ = f"flatten_into_kept_bucket_{index}"
        self.buffers: list[torch.Tensor] = []

    def __call__(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        first = tensors[0]
        if any(t.dtype != first.dtype for t in tensors):
            return flatten_concat(tensors)          # its error names the mixed dtypes
        numel = sum(t.numel() for t in tensors)
        buf = self._free(numel, first.dtype, first.device)
        return torch.cat([t.reshape(-1) for t in tensors], out=buf)

    def _free(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A kept buffer of that size that no view holds, or a new one (kept while fewer
        than ``MAX_KEPT`` are)."""
        for buf in self.buffers:
            if buf.numel() == numel and buf.dtype == dtype and buf.device == device \
                    and _unshared(buf):
                return buf
        buf = torch.empty(numel, dtype=dtype, device=device)
        if len(self.buffers) < MAX_KEPT:
            self.buffers.append(buf)
        return buf


def keep_bucket_buffers(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` (in place) with each bucket's ``flatten_concat`` packing into buffers kept
    between steps (a ``KeptBucket`` per node)."""
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is flatten_concat and BUCKET in node.meta:
            node.target = KeptBucket(node.meta[BUCKET])
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
