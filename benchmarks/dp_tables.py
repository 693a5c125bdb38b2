"""The stage DP against the plain scan (``tests/test_stages.py``'s copy of the DP before
round 7) on cost tables saved by ``search_39b.py --save-tables DIR``.

    cd benchmarks && python dp_tables.py DIR 8 8 128     # DIR, nodes, devices/node, B

Prints, per table, both CPU times, the DP runs and whether both give the same pipeline.
"""

from __future__ import annotations

import glob
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))
from test_stages import _plain_scan  # noqa: E402

from torchalpa.passes.pipeline_search.stages import stage_dp  # noqa: E402


def main() -> None:
    folder, N, M, B = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    for path in sorted(glob.glob(f"{folder}/C_*.npy")):
        C = np.load(path)

        def cost(k, i, j, s, C=C):
            return C[k, i, j, s]
        start = time.process_time()
        new = stage_dp(C.shape[0], N, M, B, cost)
        t_new = time.process_time() - start
        start = time.process_time()
        old = _plain_scan(C.shape[0], N, M, B, cost)
        t_old = time.process_time() - start
        same = old is not None and old[0] == new.total and \
            old[1] == [(s.layers, s.submesh, s.latency) for s in new.stages]
        print(f"{path}: {np.unique(C[np.isfinite(C)]).size} distinct latencies; plain scan "
              f"{t_old:.1f} s CPU, now {t_new:.2f} s CPU ({new.num_t_max_tried} DP runs); "
              f"same pipeline: {same}; total {new.total:.6g}", flush=True)


if __name__ == "__main__":
    main()
