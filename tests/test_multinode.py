"""Several nodes for real: two torchrun launchers on this machine (``--nnodes 2
--nproc_per_node 2``, a c10d rendezvous), as a job on two hosts starts. The default method
trains the quickstart MLP like one device, and the cluster and the plan know the node
boundary (torchrun's LOCAL_WORLD_SIZE ranks per launcher)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import worker_io
from test_distributed import check_matches_single_device, check_predicted_equals_executed

pytestmark = pytest.mark.slow

HERE = os.path.dirname(__file__)


def test_two_launchers_of_two_ranks_train_like_one_device_and_know_their_nodes(tmp_path):
    out = tmp_path / "result.json"
    port = worker_io.free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHALPA_TIMEOUT_S="300")
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes",
         os.path.join(HERE, "dist_worker.py"), str(out), "quickstart_auto"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for _ in range(2)]
    logs = [p.communicate(timeout=900)[0] for p in launchers]
    assert all(p.returncode == 0 for p in launchers), "\n".join(log[-3000:] for log in logs)
    result = json.loads(out.read_text())["quickstart_auto"]
    assert "error" not in result, result
    assert result["nodes"] == [2, 2]                # torchrun's layout, not one node of 4
    assert len(result["chosen"]) == 1
    if result["method"] == "PipeshardParallel":     # stages cut at the node boundary
        assert result["mesh_shape"] == [2, 2]
    assert len(result["losses"]) == 3
    check_matches_single_device(result)
    check_predicted_equals_executed(result)
