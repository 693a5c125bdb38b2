"""``torchalpa.shutdown``: the end of a distributed script without interpreter teardown,
where gloo's threads can abort a finished job (``runtime/mesh.py``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_shutdown_leaves_the_group_runs_atexit_handlers_and_exits_with_the_code(tmp_path):
    marker = tmp_path / "atexit_ran"
    script = textwrap.dedent(f"""
        import atexit
        import torch.distributed as dist
        import torchalpa
        from torchalpa.runtime.mesh import init_distributed
        init_distributed()
        atexit.register(lambda: open({str(marker)!r}, "w").write(
            "initialized" if dist.is_initialized() else "left"))
        print("done", flush=True)
        torchalpa.shutdown(3)
        print("not reached")
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 3, run.stderr[-2000:]
    assert run.stdout.split() == ["done"]
    assert marker.read_text() == "left"     # the group was left before the handlers ran
