"""The PyTorch versions the README claims hold for the code at hand (tools/torch_versions.py).

The floor's row holds the code of the version-sensitive files as it was when the whole suite ran on
that version; any later change to one of them makes the claim stale, and this test says which file and
what to rerun."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("torch_versions", ROOT / "tools" / "torch_versions.py")
tv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tv)


def test_the_floor_was_measured_on_this_code():
    problems = tv.stale(ROOT)
    assert not problems, "\n".join([*problems, "Rerun `make test-torch TORCH_SPEC=\"torch==X\"` on a fresh clone for "
                                    "each version named, then `python tools/torch_versions.py record ...` and `readme`."])


def test_readme_table_is_the_record():
    text = (ROOT / tv.README).read_text()
    assert tv.readme_with_table(text, tv.load(ROOT)) == text, "run: python tools/torch_versions.py readme"


def test_version_sensitive_files_are_the_ones_using_the_apis_that_changed():
    files = tv.sensitive_files(ROOT)
    for path in ("ddp_course/course/l11_beyond_data_parallel/pp_lab.py", "ddp_course/course/l09_fsdp/fsdp_lab.py",
                 "ddp_course/checkpoint.py", "ddp_course/dist.py", "ddp_course/parallel/fsdp.py"):
        assert path in files
    assert "ddp_course/model.py" not in files and "ddp_course/parallel/ddp.py" not in files


def _tree(tmp: Path, floor: str = "2.10") -> Path:
    """A tree of three files, one of them version-sensitive, with a floor row measured on it."""
    (tmp / "ddp_course").mkdir(parents=True)
    (tmp / "solutions" / "exercises").mkdir(parents=True)
    (tmp / "docs").mkdir()
    (tmp / "ddp_course" / "dist.py").write_text("import torch\n")
    (tmp / "ddp_course" / "lab.py").write_text("from torch.distributed.pipelining import PipelineStage\n")
    (tmp / "ddp_course" / "model.py").write_text("import torch.nn as nn\n")
    (tmp / "pyproject.toml").write_text(f'dependencies = ["torch>={floor}"]\n')
    files = {p: tv.code_digest((tmp / p).read_text()) for p in tv.sensitive_files(tmp)}
    row = {"torch": "2.10.0", "role": "floor", "ran": "whole suite", "commit": "0" * 40, "result": "green",
           "files": files}
    (tmp / tv.RECORD).write_text(json.dumps({"rows": [row]}))
    return tmp


def test_guard_fails_when_a_measured_file_changes(tmp_path):
    root = _tree(tmp_path)
    assert tv.stale(root) == []
    (root / "ddp_course" / "model.py").write_text("import torch.nn as nn\nx = 2\n")
    assert tv.stale(root) == []  # not version-sensitive
    lab = root / "ddp_course" / "lab.py"
    lab.write_text('"""A docstring."""\nfrom torch.distributed.pipelining import PipelineStage  # a comment\n')
    assert tv.stale(root) == []  # comments and docstrings are not what a version run measured
    lab.write_text("from torch.distributed.pipelining import PipelineStage\nx = 1\n")
    (problem,) = tv.stale(root)
    assert "ddp_course/lab.py: changed since that run" in problem and "2.10.0 (floor" in problem
    assert tv.main(["--root", str(root), "check"]) == 1


def test_guard_fails_when_a_file_becomes_version_sensitive(tmp_path):
    root = _tree(tmp_path)
    (root / "solutions" / "exercises" / "ex.py").write_text("from torch.distributed.fsdp import fully_shard\n")
    (root / "ddp_course" / "model.py").write_text("from torch.distributed import tensor\n")
    (problem,) = tv.stale(root)
    assert "ddp_course/model.py, solutions/exercises/ex.py: not measured by that run" in problem


def test_guard_fails_when_pyproject_floor_is_not_the_measured_one(tmp_path):
    root = _tree(tmp_path, floor="2.9")
    (problem,) = tv.stale(root)
    assert "torch>=2.9" in problem


def test_record_reads_the_digests_from_the_commit(tmp_path):
    """``record`` digests each file as git holds it at the commit named: the digest ``stale`` computes
    from the same file on disk."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        raise AssertionError("this test needs the repository's git history (a clone, shallow or not)")
    head = tv.git(ROOT, "rev-parse", "HEAD")
    for path in ("ddp_course/dist.py", "ddp_course/checkpoint.py"):
        blob = subprocess.run(["git", "show", f"{head}:{path}"], cwd=ROOT, check=True, capture_output=True,
                              text=True).stdout
        assert tv.code_digest(tv.git(ROOT, "show", f"{head}:{path}")) == tv.code_digest(blob)
        if not subprocess.run(["git", "diff", "--quiet", head, "--", path], cwd=ROOT).returncode:
            assert tv.code_digest((ROOT / path).read_text()) == tv.code_digest(blob)
