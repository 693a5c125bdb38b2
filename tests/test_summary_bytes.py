"""The bytes ``plan.summary()`` says each rank sends are what gloo ranks put on loopback:
one plan per collective kind, the collective run by the runtime's own calls on 4 ranks
inside a private network namespace (``shared/tools/netns_bytes.sh``: loopback counts every
byte the ranks exchange, once). The summary and the cost model read the same arithmetic
(``torchalpa/core/collective_math.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from torchalpa.core.collective_math import alpha_beta_seconds, sent_per_rank, wire_bytes
from torchalpa.core.plan import Collective, Plan
from torchalpa.views.report import wire_bytes as summary_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
NETNS = next((p for p in (os.environ.get("TORCHALPA_NETNS", ""),
                          os.path.join(HERE, "..", "..", "shared", "tools", "netns_bytes.sh"),
                          "/work/shared/tools/netns_bytes.sh") if p and os.path.exists(p)), None)
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _plan(kind: str, n: int, nbytes: int) -> Plan:
    c = Collective(kind=kind, axis=0, bytes=nbytes, phase="backward", source="", tensor="x")
    return Plan(mesh_shape=(n,), axis_names=("data",), parameters=(), inputs=(),
                strategies=(), reshards=(), collectives=(c,))


def test_summary_reports_the_ring_bytes_the_cost_model_prices():
    n, b = 4, 1 << 20
    sent = {k: summary_bytes(_plan(k, n, b), _plan(k, n, b).collectives[0]) for k in KINDS}
    # a ring: all-reduce 2(n-1)/n B, all-gather (n-1) blocks of B, reduce-scatter and
    # all-to-all (n-1)/n of what a rank holds (no process group here: NCCL's ring)
    assert sent == {"all_reduce": 2 * 3 / 4 * b, "all_gather": 3 * b,
                    "reduce_scatter": 3 / 4 * b, "all_to_all": 3 / 4 * b}
    for k in KINDS:
        assert sent[k] == wire_bytes(k, n, b) / n == sent_per_rank(k, n, b)
    # the cost model's bandwidth term of an all-gather is the bytes a rank sends
    assert alpha_beta_seconds("all_gather", n, b, 0.0, 1.0) == pytest.approx(sent["all_gather"])
    assert "3.0 MiB sent per rank" in _plan("all_gather", n, b).summary()


@pytest.mark.slow
@pytest.mark.skipif(NETNS is None, reason="needs shared/tools/netns_bytes.sh")
@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="a private network namespace needs root and unshare")
def test_summary_bytes_equal_what_gloo_ranks_send_on_loopback(tmp_path):
    out = tmp_path / "bytes.json"
    cmd = [NETNS, sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
           "--nproc_per_node=4", "--master_addr=127.0.0.1", "--master_port=29531",
           os.path.join(HERE, "summary_bytes_worker.py"), str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = json.loads(out.read_text())
    assert set(found) == set(KINDS)
    for kind, r in found.items():
        # TCP/IP headers and gloo's framing add 0.2-0.4% (measured: 1.0015-1.0036)
        assert r["summary"] <= r["loopback"] <= 1.01 * r["summary"], (kind, r)
        assert "sent per rank" in r["text"]
