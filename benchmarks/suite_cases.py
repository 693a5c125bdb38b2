"""Train named cases of ``torchalpa.suite.cases`` on 4 gloo ranks next to one device and
check them as ``tests/test_suite.py`` does, without launching a quarter of the slow set.

``pytest -m slow tests/test_suite.py -k NAME`` runs NAME inside the launch of every slow
case that shares its launch (a dozen models); after adding or fixing a few cases this
runs just those, in one launch:

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/suite_cases.py tv_fcn,tv_fcn@2x2

Prints the launch's wall time and, per case, OK with its losses and largest gradient and
parameter differences, or FAIL with the assertion; exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import worker_io  # noqa: E402  (tests/, on the path above)
from test_suite import check  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", help="comma-separated suite cases; NAME@2x2 for the 2x2 mesh")
    args = parser.parse_args(argv)
    names = args.names.split(",")
    out = pathlib.Path(tempfile.mkdtemp()) / "suite.json"
    start = time.perf_counter()
    results = worker_io.launch("suite_worker.py", out, ",".join(names), nproc=4,
                               timeout=3600, timeout_env="600")
    print(f"wall {time.perf_counter() - start:.1f} s, load {os.getloadavg()[0]:.1f}")
    failed = 0
    for name in names:
        r = results[name]
        try:
            check(results, name)
        except BaseException as e:  # noqa: BLE001 -- pytest's xfail/assertions, reported
            failed += 1
            print(f"{name} FAIL {type(e).__name__}: {str(e)[:2000]}")
            continue
        print(f"{name} OK losses {r['losses']} max_rel_grad_diff {r['max_rel_grad_diff']:.2e} "
              f"max_param_diff {r['max_param_diff']:.2e}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
