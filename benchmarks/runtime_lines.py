"""Lines of the runtime then and now: the modules issue 12 measured, per module, from git.

    python benchmarks/runtime_lines.py                # against 90d3f98, issue 12's 4396 lines
    python benchmarks/runtime_lines.py --before REV --after HEAD
    python benchmarks/runtime_lines.py --per-commit   # each commit's net lines since REV

Counts every line (``wc -l``) of ``runtime/*.py``, ``torchalpa/parallel/api.py`` and
``torchalpa/parallel/pipeshard.py`` -- what the issue counted when it was filed -- at two
revisions, and splits the total three ways: modules in both (the runtime that existed,
before and after), modules gone, and modules added since (features that landed after the
issue, each with the commit subject that created it), so "the runtime shrank" is measured
on the code that existed and the new features are shown, not hidden in one total.
"""

from __future__ import annotations

import argparse
import subprocess

COUNTED = ("runtime/", "torchalpa/parallel/api.py", "torchalpa/parallel/pipeshard.py")
ORCHESTRATION = ("torchalpa/parallel/shard.py", "torchalpa/parallel/workflow.py")
"""Where api.py's orchestration went when it was split by method (d8be5ce, 5004164): not
counted when the issue was filed (they did not exist), so ``--with-orchestration`` adds
them to both sides for a total that hides no moved code."""


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], check=True, capture_output=True, text=True).stdout


def lines_at(rev: str, counted=COUNTED) -> dict[str, int]:
    """Line count of each counted Python file at ``rev``."""
    files = [f for f in _git("ls-tree", "-r", "--name-only", rev, "--", *counted).split()
             if f.endswith(".py")]
    return {f: _git("show", f"{rev}:{f}").count("\n") for f in files}


def created_by(path: str, after: str) -> str:
    """The subject of the commit that added ``path`` (up to ``after``)."""
    out = _git("log", "--diff-filter=A", "--format=%h %s", after, "--", path).splitlines()
    return out[-1][:70] if out else ""


def per_commit(before: str, after: str, counted) -> list[tuple[str, int, int, str]]:
    """(hash, lines added, lines removed, subject) of each non-merge commit in
    ``before..after`` touching the counted files (merges only join what their parents
    wrote, so each line is counted once, in the commit that wrote it)."""
    out = _git("log", "--no-merges", "--numstat", "--format=@%h %s", f"{before}..{after}",
               "--", *counted)
    rows: list[tuple[str, int, int, str]] = []
    for line in out.splitlines():
        if line.startswith("@"):
            sha, _, subject = line[1:].partition(" ")
            rows.append((sha, 0, 0, subject[:80]))
        elif line.strip() and rows:
            added, removed, path = line.split("\t")
            if path.endswith(".py") and added != "-":
                sha, a, r, subject = rows[-1]
                rows[-1] = (sha, a + int(added), r + int(removed), subject)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="90d3f98", help="issue 12's revision (4396 lines)")
    p.add_argument("--after", default="HEAD")
    p.add_argument("--with-orchestration", action="store_true",
                   help="count torchalpa/parallel/shard.py and workflow.py too (api.py's split-off code)")
    p.add_argument("--per-commit", action="store_true",
                   help="each commit's net lines on the counted files, those that shrank first")
    args = p.parse_args(argv)
    counted = COUNTED + (ORCHESTRATION if args.with_orchestration else ())
    if args.per_commit:
        rows = per_commit(args.before, args.after, counted)
        for sha, a, r, subject in sorted(rows, key=lambda row: row[1] - row[2]):
            print(f"{sha} {a - r:+6d} (+{a} -{r}) {subject}")
        shrank = [row for row in rows if row[1] < row[2]]
        print(f"\n{len(rows)} commits: {len(shrank)} shrank the counted code by "
              f"{sum(r - a for _, a, r, _ in shrank)} lines, the others grew it by "
              f"{sum(a - r for _, a, r, _ in rows if a >= r)}")
        return
    before, after = lines_at(args.before, counted), lines_at(args.after, counted)
    kept = sorted(set(before) & set(after))
    gone = sorted(set(before) - set(after))
    new = sorted(set(after) - set(before), key=lambda f: -after[f])
    print(f"{'module':34s} {args.before:>9s} {args.after:>9s}")
    for f in kept:
        print(f"{f:34s} {before[f]:9d} {after[f]:9d} {after[f] - before[f]:+6d}")
    for f in gone:
        print(f"{f:34s} {before[f]:9d} {'gone':>9s} {-before[f]:+6d}")
    for f in new:
        print(f"{f:34s} {'new':>9s} {after[f]:9d}   {created_by(f, args.after)}")
    then = sum(before.values())
    kept_before, kept_after = sum(before[f] for f in kept), sum(after[f] for f in kept)
    print(f"\ntotal: {then} -> {sum(after.values())} lines")
    print(f"modules that existed, still here: {kept_before} -> {kept_after} "
          f"({kept_after - kept_before:+d}); gone: {sum(before[f] for f in gone)} lines "
          f"in {len(gone)} modules; added since: {sum(after[f] for f in new)} lines "
          f"in {len(new)} modules")


if __name__ == "__main__":
    main()
