"""The README's first section on a fresh Debian-like machine: what ``make``'s set-up does with the Python
it finds (tools/setup_python.py), JupyterLab's terminals, and the conda route installing what pip does.

The Python a newcomer has is played by a wrapper around this one: a ``sitecustomize`` on its path
hides ``ensurepip`` (Debian without ``python3-venv``) or puts an old torch's metadata in front of the
real one (Debian 12's ``python3-torch`` 1.13.1). Nothing is installed: the Makefile stops before pip.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
from harness import ROOT, run_command

if shutil.which("make") is None:
    pytest.fail("these tests run make, which the README's two commands need anyway")


def python_wrapper(tmp_path: Path, sitecustomize: str) -> Path:
    """An executable that runs this Python with ``sitecustomize`` loaded first."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(sitecustomize)
    wrapper = tmp_path / "python3"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{site}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


NO_ENSUREPIP = "import sys\nsys.modules['ensurepip'] = None  # as on Debian without python3-venv\n"


def old_torch(tmp_path: Path, version: str) -> str:
    """A sitecustomize that makes ``torch`` importable-looking at ``version`` (metadata and a spec)."""
    fake = tmp_path / "fake_torch"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("")
    (fake / f"torch-{version}.dist-info").mkdir()
    (fake / f"torch-{version}.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return f"import sys\nsys.path.insert(0, {str(fake)!r})\n"


def test_make_says_in_one_line_what_to_install_when_venv_cannot_work(tmp_path):
    python = python_wrapper(tmp_path, NO_ENSUREPIP)
    venv = tmp_path / "venv"
    r = run_command(["make", "--no-print-directory", "setup", f"PYTHON={python}", f"VENV={venv}"], timeout=60,
                    check=False)
    assert r.returncode != 0 and not venv.exists()
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "sudo apt install python3-venv" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_an_old_system_torch_is_left_out_and_said_so(tmp_path):
    python = python_wrapper(tmp_path, old_torch(tmp_path, "1.13.1"))
    r = run_command([str(python), "tools/setup_python.py", "torch", "--floor", "2.10", "--spec", "torch==2.13.0"],
                    timeout=30, check=False)
    assert r.returncode == 1
    assert "has torch 1.13.1, older than the 2.10 this course needs" in r.stdout and "installs torch==2.13.0" in r.stdout


def test_a_system_torch_at_the_floor_or_newer_is_kept(tmp_path):
    for version in ("2.10.0", "2.13.0+cpu", "3.0.1"):
        where = tmp_path / version
        where.mkdir()
        python = python_wrapper(where, old_torch(where, version))
        r = run_command([str(python), "tools/setup_python.py", "torch", "--floor", "2.10", "--spec", "torch==2.13.0"],
                        timeout=30, check=False)
        assert r.returncode == 0 and r.stdout.startswith("[setup] using the torch already installed for ")
        assert r.stdout.rstrip().endswith(f": {version}")


def test_the_floor_make_checks_is_pyprojects():
    r = run_command(["make", "--no-print-directory", "-n", "setup", "VENV=/nonexistent/venv"], timeout=30)
    floor = re.search(r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert f'tools/setup_python.py torch --floor "{floor}"' in r.stdout
    assert "tools/setup_python.py venv" in r.stdout


def test_jupyterlab_runs_with_the_venv_on_its_path():
    """A terminal opened in JupyterLab inherits the server's environment: the venv's bin comes first."""
    # VENV named here: under `make test-torch` the suite's own make passes another VENV down (MAKEFLAGS)
    r = run_command(["make", "--no-print-directory", "-n", "lab", "VENV=.venv"], timeout=30)
    line = next(line for line in r.stdout.splitlines() if line.startswith("PATH="))
    assert line.startswith(f'PATH="{ROOT / ".venv"}/bin:$PATH"') and "VIRTUAL_ENV=" in line


def test_the_conda_route_installs_what_make_installs():
    makefile = (ROOT / "Makefile").read_text()
    conda = (ROOT / "environment.yml").read_text()
    extras = lambda text: [set(m.split(",")) for m in re.findall(r"-e \"?\.\[([a-z,-]+)\]", text)]  # noqa: E731
    make_setup = extras(makefile)[0]  # the setup stamp's install
    assert extras(conda) == [make_setup | {"lab"}], "environment.yml must install make's extras plus JupyterLab"
    assert re.search(r"torch>=([0-9.]+)", conda).group(1) == re.search(
        r'"torch>=([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
