"""A strategy with options of its own is one file: written into a copy of the course, with no other file
touched, its options appear in ``--help`` under it, its values are validated, the contract tests pass
with it, and the every-strategy test trains it (collected with the values its file says it needs)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from harness import ROOT, run_command

# DDP whose buckets are views of the gradients, with an option of its own
BUCKET_VIEWS = '''"""DDP with --bucket_views: DDP's gradient buckets are views of the gradients (one copy less)."""

from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_course.parallel import ddp

OPTIONS = {**ddp.OPTIONS, "bucket_views": (False, "let the gradients be views into DDP's buckets", None)}
HELP_ORDER = 2

sync_context = ddp.sync_context
unwrap = ddp.unwrap


def wrap(model, info, cfg):
    device_ids = [info.device.index] if info.device.type == "cuda" else None
    return DDP(model, device_ids=device_ids, gradient_as_bucket_view=cfg.bucket_views, **ddp.ddp_kwargs(cfg))
'''

PROBE = '''
import sys
sys.path.insert(0, {root!r})
import pytest
from ddp_course import config, parallel

assert config.__file__.startswith({root!r}), config.__file__
text = config.help_text()
lines = text.split("strategies (--strategy=NAME)")[1].splitlines()
at = next(i for i, line in enumerate(lines) if line.startswith("  bucket_views "))
own = [line.split()[0] for line in lines[at + 1:] if line.startswith("      ")][:6]
assert own[-1] == "--bucket_views=False" and "--bucket_cap_mb=25.0" in own, own
try:
    config.parse_cli(["--strategy=bucket_views", "--bucket_views=maybe"])
except config.ConfigError as exc:
    assert "--bucket_views expects" in str(exc), exc
else:
    raise AssertionError("--bucket_views=maybe was accepted")
assert config.parse_cli(["--strategy=bucket_views", "--bucket_views"]).bucket_views is True
parallel.check_module(parallel.Strategy("bucket_views").module)
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", {root!r},
                      {root!r} + "/tests/core/test_strategy_contract.py",
                      {root!r} + "/tests/core/test_every_strategy.py", "--collect-only" if {collect} else "-ra"]))
'''


def _copy_with_a_new_strategy(tmp_path: Path) -> Path:
    root = tmp_path / "course"
    ignore = shutil.ignore_patterns("__pycache__")
    for part in ("ddp_course", "tests", "pyproject.toml"):
        (shutil.copytree if (ROOT / part).is_dir() else shutil.copy2)(ROOT / part, root / part, **(
            {"ignore": ignore} if (ROOT / part).is_dir() else {}))
    (root / "ddp_course" / "parallel" / "bucket_views.py").write_text(BUCKET_VIEWS, encoding="utf-8")
    return root


def test_a_new_strategy_with_an_option_of_its_own_needs_no_other_file(tmp_path):
    root = _copy_with_a_new_strategy(tmp_path)
    contract = run_command([sys.executable, "-c", PROBE.format(root=str(root), collect=False).replace(
        f'{str(root)!r} + "/tests/core/test_every_strategy.py", ', "")], timeout=240)
    assert " passed" in contract.stdout and "failed" not in contract.stdout, contract.stdout[-3000:]
    collected = run_command([sys.executable, "-c", PROBE.format(root=str(root), collect=True)], timeout=120)
    assert "test_a_resumed_run_ends_where_the_uninterrupted_one_ends[bucket_views-full]" in collected.stdout, \
        collected.stdout[-3000:]
