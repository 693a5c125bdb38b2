"""Where ``make test``'s time goes, from a pytest JUnit XML report (issue 12, item 6).

Run the suite with ``--junitxml=FILE`` (and ``-n 2 --dist loadfile`` as ``make test`` does),
then ``python benchmarks/test_times.py FILE``: per test file, its tests' summed seconds
(call plus the setup/teardown that pytest attributes to them, which holds module fixtures
such as a shared capture or a rank-pool launch), largest first; then the largest single
tests. Under ``--dist loadfile`` a file runs whole on one worker, so the largest file is a
floor on the wall time: a file above about half the total leaves the other worker idle.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET


def per_test(path: str) -> list[tuple[str, str, float]]:
    """(file, test name, seconds) for every test case in the JUnit report at ``path``."""
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((m for m in module if m.startswith("test_")), module[-1])
        rows.append((name + ".py", case.get("name", ""), float(case.get("time", 0.0))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit_xml")
    parser.add_argument("--files", type=int, default=30, help="largest files to list")
    parser.add_argument("--tests", type=int, default=30, help="largest tests to list")
    args = parser.parse_args()

    rows = per_test(args.junit_xml)
    by_file: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.Counter()
    for file, _, seconds in rows:
        by_file[file] += seconds
        counts[file] += 1
    total = sum(by_file.values())
    print(f"{len(rows)} tests, {total:.1f} s summed over files "
          f"(two workers: wall >= {total / 2:.1f} s)")
    print(f"{'seconds':>8} {'share':>6} {'tests':>5}  file")
    for file, seconds in sorted(by_file.items(), key=lambda kv: -kv[1])[:args.files]:
        print(f"{seconds:8.1f} {seconds / total:6.1%} {counts[file]:5d}  {file}")
    print(f"\n{'seconds':>8}  test")
    for file, name, seconds in sorted(rows, key=lambda r: -r[2])[:args.tests]:
        print(f"{seconds:8.1f}  {file}::{name}")


if __name__ == "__main__":
    main()
