"""The README's first section on a fresh Debian-like machine: what ``make``'s set-up does with the Python
it finds (tools/setup_python.py), JupyterLab's terminals, and the conda route installing what pip does.

The Python a newcomer has is played by a wrapper around this one: a ``sitecustomize`` on its path
hides ``ensurepip`` (Debian without ``python3-venv``) or puts an old torch's metadata in front of the
real one (Debian 12's ``python3-torch`` 1.13.1). Nothing is installed: the Makefile stops before pip.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
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


def course_with_a_venv(tmp_path: Path, fake_pip: bool = True) -> tuple[Path, Path]:
    """A checkout in a folder whose name has a space, with the Makefile, its set-up tool and a venv already
    set up, whose python reports what it is asked to run (pip and JupyterLab are only named, never run)."""
    course = tmp_path / "my course"
    (course / "tools").mkdir(parents=True)
    for name in ("Makefile", "pyproject.toml", "tools/setup_python.py"):
        shutil.copy(ROOT / name, course / name)
    venv = course / ".venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text('#!/bin/sh\nif [ "$1" = "-m" ] && [ "$2" != "ddp_course" -o "$3" = "update" ]; then\n'
                      '  echo "ran: $*"; echo "PATH=$PATH"; echo "VIRTUAL_ENV=$VIRTUAL_ENV"; echo "WORK=$DDP_COURSE_WORK"\n'
                      '  echo "CWD=$PWD"\n'
                      f'  exit 0\nfi\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    for stamp in (".ddp_course-installed", ".ddp_course-lab-installed"):
        (venv / stamp).touch()
    return course, venv


def test_jupyterlab_opens_the_workspace_with_the_venv_on_its_path_from_a_folder_with_a_space(tmp_path):
    """A terminal opened in JupyterLab inherits the server's environment: the venv's bin comes first, and
    DDP_COURSE_WORK names the workspace, which `make lab` makes or updates first and JupyterLab opens and
    runs in (a terminal starts there). Its terminals run the user's shell, not a login shell, whose
    /etc/profile would put the system's PATH back (seen with JupyterLab 4 in a container: its terminal's
    `python` was the system's, without torch)."""
    course, venv = course_with_a_venv(tmp_path)
    (course / "work").mkdir()  # as `update` (played by the fake python) would have made it
    r = run_command(["make", "--no-print-directory", "-C", str(course), "lab"], timeout=60,
                    env={"DDP_COURSE_WORK": "", "SHELL": "/bin/bash"})
    runs = r.stdout.split("ran: ")[1:]
    assert [run.splitlines()[0].split()[:3] for run in runs] == [["-m", "ddp_course", "update"], ["-m", "jupyter", "lab"]]
    update, lab = runs
    assert f"WORK={course}/work\n" in update
    assert f"--ServerApp.root_dir={course}/work" in lab.splitlines()[0]
    assert f'--ServerApp.terminado_settings=shell_command=["{course}/tools/lab_shell"]' in lab.splitlines()[0]
    assert f"PATH={venv}/bin:" in lab and f"VIRTUAL_ENV={venv}\n" in lab and f"WORK={course}/work\n" in lab
    assert f"CWD={course}/work\n" in lab
    (tmp_path / "my work").mkdir()
    elsewhere = run_command(["make", "--no-print-directory", "-C", str(course), "lab", f"WORK={tmp_path}/my work"],
                            timeout=60)
    assert f"--ServerApp.root_dir={tmp_path}/my work" in elsewhere.stdout


@pytest.mark.parametrize("shell", ["bash", "zsh", "sh"])
def test_a_terminal_in_jupyterlab_finds_the_venvs_python_first_whatever_the_users_start_up_files(shell, tmp_path):
    """tools/lab_shell, the shell of JupyterLab's terminals: the user's start-up files run (here one puts
    another python first, as pyenv's or conda's init does), then the venv comes first again."""
    if shutil.which(shell) is None:
        pytest.skip(f"no {shell} on this machine")
    home, other, venv = tmp_path / "home", tmp_path / "other" / "bin", tmp_path / "venv"
    for folder, word in ((other, "other"), (venv / "bin", "venv")):
        folder.mkdir(parents=True)
        (folder / "python").write_text(f"#!/bin/sh\necho {word}\n")
        (folder / "python").chmod(0o755)
    home.mkdir()
    for rc in (".bashrc", ".zshrc"):
        (home / rc).write_text(f'export PATH="{other}:$PATH"\n')
    env = {"HOME": str(home), "SHELL": shutil.which(shell), "VIRTUAL_ENV": str(venv),
           "PATH": f"{venv / 'bin'}:{os.environ['PATH']}"}
    r = subprocess.run([str(ROOT / "tools" / "lab_shell")], input="python\nexit\n", capture_output=True, text=True,
                       env=env, timeout=30)
    assert r.stdout.split()[-1:] == ["venv"], (r.stdout, r.stderr)


def test_a_python_older_than_310_is_refused_in_one_line_naming_another(tmp_path):
    python = python_wrapper(tmp_path, "import sys\nsys.version_info = (3, 8, 10, 'final', 0)  # as macOS's python3\n")
    venv = tmp_path / "venv"
    r = run_command(["make", "--no-print-directory", "setup", f"PYTHON={python}", f"VENV={venv}"], timeout=60,
                    check=False)
    assert r.returncode != 0 and not venv.exists()
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Python 3.8.10" in errors[0] and "PYTHON=python3.11" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def test_a_torch_spec_asked_for_on_an_existing_venv_is_installed(tmp_path):
    course, venv = course_with_a_venv(tmp_path)
    (venv / ".ddp_course-torch").write_text("torch==2.13.0\n")
    make = ["make", "--no-print-directory", "-C", str(course), "setup"]
    assert "ran:" not in run_command(make, timeout=60).stdout  # nothing asked: nothing installed
    assert "ran:" not in run_command([*make, "TORCH_SPEC=torch==2.13.0"], timeout=60).stdout  # what it has
    r = run_command([*make, "TORCH_SPEC=torch==2.11.0", "TORCH_PIP_ARGS=--index-url https://download.pytorch.org/whl/cpu"],
                    timeout=60)
    assert "was set up with torch==2.13.0; installing torch==2.11.0 --index-url" in r.stdout, r.stdout
    assert "ran: -m pip install --quiet --index-url https://download.pytorch.org/whl/cpu torch==2.11.0" in r.stdout
    assert (venv / ".ddp_course-torch").read_text().split() == ["torch==2.11.0", "--index-url",
                                                                 "https://download.pytorch.org/whl/cpu"]
    again = run_command([*make, "TORCH_SPEC=torch==2.11.0", "TORCH_PIP_ARGS=--index-url https://download.pytorch.org/whl/cpu"],
                        timeout=60)
    assert "ran:" not in again.stdout


def test_the_conda_route_installs_what_make_installs_and_pins_the_same_torch():
    makefile = (ROOT / "Makefile").read_text()
    conda = (ROOT / "environment.yml").read_text()
    spec = re.search(r"^TORCH_SPEC\s*\?=\s*(\S+)", makefile, re.M).group(1)
    assert re.search(rf"^\s*- {re.escape(spec)}\s*$", conda, re.M), f"environment.yml must pin {spec}, as make does"
    extras = lambda text: [set(m.split(",")) for m in re.findall(r"-e \"?\.\[([a-z,-]+)\]", text)]  # noqa: E731
    make_setup = extras(makefile)[0]  # the setup stamp's install
    assert extras(conda) == [make_setup | {"lab"}], "environment.yml must install make's extras plus JupyterLab"
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in conda  # how to take the CPU build
