"""The PyTorch versions the course claims, and whether each claim still holds for the code at hand.

    python tools/torch_versions.py check     # exit 1, naming the files, if a guarded row is stale
    python tools/torch_versions.py readme    # rewrite README.md's version table from the record
    python tools/torch_versions.py record --torch 2.10.0 --commit <hash> --result "..."   # after a run

``docs/torch_versions.json`` is the record: one row per version tried, with the commit it ran at. The
row whose ``role`` is ``floor`` (the version ``pyproject.toml`` asks for at least) is *guarded*: it
also holds a digest of the code of every version-sensitive file as it was at that commit (its syntax
tree without comments and docstrings, ``code_digest``). The other rows, the newest release's included,
show their commit in the README's table, so that a reader sees how old each one is. A file is version-sensitive when it imports one of the parts of PyTorch that
changed behaviour between the releases the course was run on (``SENSITIVE_APIS``: the pipelining
stage's stride check in 2.10, FSDP2's reduce op on gloo before 2.8, DCP's state dicts), or is named in
``ALSO`` with its reason. When any of them differs from what the floor's run measured, or a new one
appears, ``check`` fails (``tests/course/test_torch_versions.py`` runs it in ``make test``) until the
suite is rerun on that version (``make test-torch TORCH_SPEC="torch==X"`` on a fresh clone) and the
row recorded again. The digests are computed from the files themselves, so a shallow clone checks the
same way as a full one; a reworded comment or docstring leaves a claim standing.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = Path("docs/torch_versions.json")
README = Path("README.md")
# where version-sensitive code can live: the package and the answered exercise scripts
SCANNED = ("ddp_course", "solutions/exercises")
SENSITIVE_APIS = (
    "torch.distributed.pipelining",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.device_mesh",
    "torch.distributed.checkpoint",
    "torch.distributed._composable",
    "torch.distributed.optim",
)
ALSO = {
    "ddp_course/dist.py": "the exit guard: gloo's workers outlive the interpreter from 2.11 on (EXIT_GUARD_NEEDED_FROM)",
}
GUARDED_ROLES = ("floor",)  # the claim pyproject.toml makes; the other rows say at which commit they ran
TABLE_START, TABLE_END = "<!-- torch-versions: made by tools/torch_versions.py readme -->", "<!-- /torch-versions -->"


def imports_of(source: str) -> set[str]:
    """Every module a Python source imports, ``from a import b`` counted as both ``a`` and ``a.b``."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{alias.name}" for alias in node.names)
    return out


def sensitive_files(root: Path) -> list[str]:
    """The version-sensitive files of the tree at ``root``, as sorted paths relative to it."""
    found = set(ALSO)
    for top in SCANNED:
        for path in sorted((root / top).rglob("*.py")):
            mods = imports_of(path.read_text())
            if any(m == api or m.startswith(api + ".") for m in mods for api in SENSITIVE_APIS):
                found.add(path.relative_to(root).as_posix())
    return sorted(found)


def code_digest(source: str) -> str:
    """A digest of what a file *does*: its syntax tree without comments and docstrings, so that a
    reworded comment leaves a version claim standing and any change of code does not."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()[:16]


def load(root: Path) -> dict:
    return json.loads((root / RECORD).read_text())


def stale(root: Path) -> list[str]:
    """One line per way the guarded rows no longer describe the code at ``root``; empty when they do."""
    record = load(root)
    now = {p: code_digest((root / p).read_text()) for p in sensitive_files(root)}
    problems = []
    for row in record["rows"]:
        if row.get("role") not in GUARDED_ROLES:
            continue
        then = row.get("files", {})
        changed = sorted(p for p in now if p in then and then[p] != now[p])
        new = sorted(p for p in now if p not in then)
        gone = sorted(p for p in then if p not in now)
        where = f"PyTorch {row['torch']} ({row['role']}, measured at {row['commit'][:10]})"
        for kind, paths in (("changed since", changed), ("not measured by", new),
                            ("gone or no longer version-sensitive since", gone)):
            if paths:
                problems.append(f"{where}: {', '.join(paths)}: {kind} that run")
    floor = [r for r in record["rows"] if r.get("role") == "floor"]
    pyproject = (root / "pyproject.toml").read_text()
    asked = re.search(r'"torch>=([0-9.]+)"', pyproject)
    if len(floor) != 1 or not asked or not floor[0]["torch"].startswith(asked.group(1)):
        problems.append(f"pyproject.toml asks for torch>={asked.group(1) if asked else '?'}, "
                        f"but the record's floor row is {[r['torch'] for r in floor]}")
    return problems


def table(record: dict) -> str:
    """README's version table, from the record."""
    lines = ["| PyTorch | what ran | measured at | result |", "|---|---|---|---|"]
    for row in record["rows"]:
        role = {"floor": " (the floor)", "newest": " (newest tried)"}.get(row.get("role", ""), "")
        at = f"`{row['commit'][:10]}`" if row["commit"] else "every commit (CI)"
        lines.append(f"| {row['torch']}{role} | {row['ran']} | {at} | {row['result']} |")
    return "\n".join(lines)


def readme_with_table(text: str, record: dict) -> str:
    start, end = text.index(TABLE_START), text.index(TABLE_END)
    return text[: start + len(TABLE_START)] + "\n" + table(record) + "\n" + text[end:]


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def record_run(root: Path, torch: str, commit: str, result: str, ran: str | None, date: str | None) -> dict:
    """Put (or replace) the row of ``torch`` with a run at ``commit``, the digests read from that commit."""
    commit = git(root, "rev-parse", commit)
    record = load(root)
    rows = [r for r in record["rows"] if r["torch"] == torch]
    if not rows:
        raise SystemExit(f"error: no row for {torch} in {RECORD}; add it by hand first (its role, what ran).")
    row = rows[0]
    row.update(commit=commit, result=result, date=date or git(root, "show", "-s", "--format=%cs", commit))
    if ran:
        row["ran"] = ran
    if row.get("role") in GUARDED_ROLES:
        row["files"] = {p: code_digest(git(root, "show", f"{commit}:{p}")) for p in sensitive_files(root)}
    (root / RECORD).write_text(json.dumps(record, indent=1) + "\n")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/torch_versions.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="exit 1 if a guarded row is stale")
    sub.add_parser("readme", help="rewrite README.md's version table from the record")
    rec = sub.add_parser("record", help="record a run of the whole suite on one version")
    rec.add_argument("--torch", required=True, help="the row's version, as the record spells it")
    rec.add_argument("--commit", required=True, help="the commit the run was made at")
    rec.add_argument("--result", required=True, help="what it gave, e.g. '1051 passed, 22 skipped, 16 min 2 s'")
    rec.add_argument("--ran", help="what ran (default: the row's)")
    rec.add_argument("--date", help="YYYY-MM-DD (default: the commit's)")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    if args.cmd == "record":
        row = record_run(root, args.torch, args.commit, args.result, args.ran, args.date)
        print(f"recorded {row['torch']} at {row['commit'][:10]}; now run: python tools/torch_versions.py readme")
        return 0
    if args.cmd == "readme":
        (root / README).write_text(readme_with_table((root / README).read_text(), load(root)))
        return 0
    problems = stale(root)
    for line in problems:
        print(line)
    if problems:
        print("Rerun the suite on each version named (make test-torch TORCH_SPEC=\"torch==X\" on a fresh clone), "
              "then: python tools/torch_versions.py record ... and readme.")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
