"""Write the learner copies in ``lessons/`` from the answer keys in ``solutions/``.

    python tools/make_lessons.py            # write lessons/*.ipynb and lessons/exercises/*.py
    python tools/make_lessons.py --check    # exit 1 if any learner file is stale, missing or orphaned
    python tools/make_lessons.py --prune    # write, and delete learner files that have no solution
    python tools/make_lessons.py --answered build/learner   # the lessons as a learner completes them

The command line only: the rewrite (the ``# BEGIN SOLUTION`` / ``# END SOLUTION`` / ``# SOLUTION
CELL`` markers, the ``solution-only`` tag, what ``--answered`` writes) is ``ddp_course.check.rewrite``,
whose docstring describes it; the grading harness uses the same rewrite.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddp_course.check.rewrite import FIX, MarkerError, check, generate, write_answered

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/make_lessons.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="verify only; exit 1 if lessons/ is out of date")
    parser.add_argument("--prune", action="store_true", help="also delete learner files that have no solution")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    parser.add_argument("--answered", type=Path, metavar="DIR",
                        help="instead, write the lessons as completed by a learner (answers in place of the "
                             "TODOs, no markers, the solutions' outputs) into DIR, e.g. build/learner")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    try:
        if args.answered is not None:
            out = args.answered if args.answered.is_absolute() else Path.cwd() / args.answered
            written, stale = write_answered(root, out)
            for path in stale:
                print(f"deleted {path}")
            print(f"{len(written)} answered file(s) in {out.resolve()}")
            return 0
        if args.check:
            problems, n_files = check(root)
            if problems:
                for line in problems:
                    print(line)
                print(f"lessons out of sync with solutions: {len(problems)} problem(s); fix with `{FIX}`")
                return 1
            print(f"OK: lessons in sync with solutions ({n_files} file(s))")
            return 0
        written, unchanged, orphans = generate(root, prune=args.prune)
    except MarkerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path.relative_to(root)}")
    for path in orphans:
        rel = path.relative_to(root)
        print(f"deleted orphan {rel}" if args.prune else f"warning: {rel} has no solution (`{FIX} --prune` deletes it)")
    print(f"{len(written)} written, {len(unchanged)} unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
