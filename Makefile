# The course's two commands (see README.md):
#   make lab    set up .venv if needed, make or update your workspace (work/), then open it in JupyterLab
#   make test   set up .venv if needed, then run the whole test suite (what CI runs; it never reads work/)
#   make test-torch TORCH_SPEC="torch==2.10.0"   the whole suite on another PyTorch, in .venv-torch/
#
# Paths may hold spaces: every path a recipe uses is quoted, and none goes through make's own
# word-splitting functions ($(abspath), $(wildcard)).
#
# Set-up keeps a torch that is already importable by $(PYTHON) and at least the course's floor
# (the venv then sees the system's site-packages); otherwise it installs $(TORCH_SPEC) into an
# isolated venv (tools/setup_python.py says which, in one line). See README.md for GPU and CPU-only wheels.

PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
# extra pip options for the torch install, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=
PORT        ?= 8888
# the learner's workspace: their copies of the lessons, made from lessons/ by `make lab` (untracked)
WORK        ?= $(if $(DDP_COURSE_WORK),$(DDP_COURSE_WORK),work)
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.ddp_course-installed
LAB_STAMP   := $(VENV)/.ddp_course-lab-installed
PYTEST_ARGS ?=
# pytest workers (pytest-xdist), each taking whole files: a notebook's cells run in order on one worker
TEST_WORKERS ?= 2
# 1: a torch already importable by $(PYTHON) is used when it is at least TORCH_FLOOR (the venv sees
# the system's site-packages); 0: the venv is isolated and gets $(TORCH_SPEC) (what `make test-torch` does)
SYSTEM_TORCH ?= 1
# the oldest torch the course supports, read from pyproject.toml's "torch>=X"
TORCH_FLOOR := $(shell sed -n 's/.*"torch>=\([0-9.]*\)".*/\1/p' pyproject.toml)
# `make test-torch`'s venv for TORCH_SPEC, e.g. .venv-torch/torch__2.8.0 for "torch==2.8.0"
TORCH_VENV  := .venv-torch/$(shell printf '%s' '$(TORCH_SPEC)' | tr -c 'A-Za-z0-9.' '_')
# JupyterLab refuses to run as root unless told to (containers often run as root)
ROOT_FLAG   := $(if $(filter 0,$(shell id -u)),--allow-root)
# Whether a Python can import torch, without importing it (seconds)
HAS_TORCH   := -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"
# Offline machines: a folder ../shared/data holding tinyshakespeare.txt, beside the checkout, is
# used when DDP_COURSE_DATA is not set (that is how CI runs without a network).
ifeq ($(origin DDP_COURSE_DATA),undefined)
  SHARED_DATA := $(shell cd "$(CURDIR)/../shared/data" 2>/dev/null && test -f tinyshakespeare.txt && pwd)
  ifneq ($(SHARED_DATA),)
    export DDP_COURSE_DATA := $(SHARED_DATA)
  endif
endif
# a TORCH_SPEC or TORCH_PIP_ARGS given on the command line or in the environment is honoured on an
# existing venv too: set-up notes what it installed ($(TORCH_RECORD)) and installs again when asked for another
TORCH_ASKED := $(filter-out default file,$(origin TORCH_SPEC) $(origin TORCH_PIP_ARGS))
TORCH_RECORD := $(VENV)/.ddp_course-torch
# a folder given relative to the checkout, made absolute by the shell (make's $(abspath) splits at spaces)
ABS         = case "$(1)" in /*) printf '%s' "$(1)";; *) printf '%s' "$$PWD/$(1)";; esac

.PHONY: lab test test-torch setup workspace clean lessons check-lessons bench-overhead site site-check

setup: $(STAMP)
ifneq ($(TORCH_ASKED),)
	@"$(PY)" tools/setup_python.py asked --record "$(TORCH_RECORD)" --spec '$(TORCH_SPEC)' --pip-args '$(TORCH_PIP_ARGS)' \
	  || { "$(PY)" -m pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)" \
	       && "$(PY)" tools/setup_python.py asked --record "$(TORCH_RECORD)" --spec '$(TORCH_SPEC)' --pip-args '$(TORCH_PIP_ARGS)' --write; }
endif

$(STAMP): pyproject.toml
	@set -e; \
	if [ ! -x "$(PY)" ]; then \
	  "$(PYTHON)" tools/setup_python.py venv; \
	  if [ "$(SYSTEM_TORCH)" != 0 ] && "$(PYTHON)" tools/setup_python.py torch --floor "$(TORCH_FLOOR)" --spec "$(TORCH_SPEC)"; then \
	    "$(PYTHON)" -m venv --system-site-packages "$(VENV)"; \
	    echo system > "$(TORCH_RECORD)"; \
	  else \
	    "$(PYTHON)" -m venv "$(VENV)"; \
	  fi; \
	fi; \
	if ! "$(PY)" $(HAS_TORCH) >/dev/null 2>&1; then \
	  echo "[setup] installing $(TORCH_SPEC)"; \
	  "$(PY)" -m pip install --quiet $(TORCH_PIP_ARGS) "$(TORCH_SPEC)"; \
	  "$(PY)" tools/setup_python.py asked --record "$(TORCH_RECORD)" --spec '$(TORCH_SPEC)' --pip-args '$(TORCH_PIP_ARGS)' --write; \
	fi; \
	echo "[setup] installing ddp_course and its tools into $(VENV)"; \
	"$(PY)" -m pip install --quiet -e ".[dev,site]"; \
	"$(PY)" -m ddp_course doctor; \
	touch "$(STAMP)"

# JupyterLab itself only for `make lab` (pyproject's `lab` extra): `make test` runs without it.
$(LAB_STAMP): $(STAMP)
	@echo "[setup] installing JupyterLab into $(VENV)"
	@"$(PY)" -m pip install --quiet -e ".[dev,lab]"
	@touch "$(LAB_STAMP)"

# The learner's workspace, $(WORK): made from lessons/ the first time, then brought up to date (new
# lessons and exercises copied in; nothing the learner changed is written over: ddp_course/check/update.py)
workspace: setup
	@DDP_COURSE_WORK="$$($(call ABS,$(WORK)))" "$(PY)" -m ddp_course update

# JupyterLab opens in the workspace, and runs there: a terminal opened in JupyterLab starts in the
# workspace (jupyter_server_terminals resolves the folder it is asked for against the server's own
# working directory first). The server runs with the venv first on its PATH (as `source
# .venv/bin/activate` would put it) and with DDP_COURSE_WORK naming the workspace; its terminals run
# tools/lab_shell, the user's shell with the venv first on PATH after their start-up files (pyenv's or
# conda's init there would put another python first; and without a shell named, jupyter_server_terminals
# starts a login shell when its output is not a terminal, whose /etc/profile puts the system's PATH back).
lab: workspace $(LAB_STAMP)
	@echo "[lab] starting JupyterLab in your workspace, $(WORK)/; open the URL below (00_setup.ipynb is the first lesson)"
	@venv="$$($(call ABS,$(VENV)))"; work="$$($(call ABS,$(WORK)))"; root="$$PWD"; cd "$$work" && \
	PATH="$$venv/bin:$$PATH" VIRTUAL_ENV="$$venv" DDP_COURSE_WORK="$$work" \
	"$$venv/bin/python" -m jupyter lab --ip=127.0.0.1 --port=$(PORT) --no-browser $(ROOT_FLAG) \
	  --ServerApp.root_dir="$$work" --ServerApp.terminado_settings="shell_command=[\"$$root/tools/lab_shell\"]"

# The notebooks run as a learner's completed copies (answers in place of the TODOs, no markers,
# the solutions' outputs kept for the cells nbval compares): build/learner, rebuilt each time. They
# run first, and the tests that read a notebook's run last (tests/conftest.py orders the files;
# --no-loadscope-reorder keeps xdist from reordering them by size): with two workers taking whole
# files, a test that checks the same job as a notebook reads the notebook's run of it
# (tests/notebook_runs.py) instead of launching it again. The course's own modules are byte-compiled
# first: every process of every job imports them, and where PYTHONDONTWRITEBYTECODE is set (CI
# machines) each process would compile them again.
test: setup
	-@"$(PY)" -m compileall -q ddp_course tests tools >/dev/null
	"$(PY)" tools/make_lessons.py --answered build/learner
	DDP_COURSE_NOTEBOOK_RUNS="$(CURDIR)/build/learner" \
	"$(PY)" -m pytest build/learner tests --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg \
	  --nbval-cell-timeout=600 -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The whole suite on another PyTorch, e.g. `make test-torch TORCH_SPEC="torch==2.8.0"`: a venv of its
# own (.venv-torch/..., kept for the next run), isolated from any torch the system has. README.md's
# "What has been run on what" lists the versions tried and their results.
test-torch:
	$(MAKE) test VENV=$(TORCH_VENV) SYSTEM_TORCH=0 TORCH_SPEC="$(TORCH_SPEC)"

# maintainers: lessons/ written from solutions/ (a learner's work is in the workspace, never here)
lessons: setup
	"$(PY)" tools/make_lessons.py

check-lessons: setup
	"$(PY)" tools/make_lessons.py --check

# The course as a static site, from solutions/ with their saved outputs (nothing is executed):
# build/site/index.html. `make site-check` then opens every page in headless Chromium (the system's:
# Debian's package `chromium`, or CHROMIUM=/path/to/chrome) and checks what a reader sees.
site: setup
	"$(PY)" tools/make_site.py build/site

site-check: site
	@"$(PY)" -m pip install --quiet -e ".[dev,site,site-check]"
	"$(PY)" tools/check_site.py build/site

bench-overhead: setup
	"$(PY)" -m ddp_course.bench overhead

# Build outputs only: the workspace (your notebooks, exercises and grading records) is never touched here
clean:
	rm -rf runs solutions/runs lessons/runs bench_results .pytest_cache build/learner build/site build/site-src build/site-check
	@echo "[clean] removed build outputs; your workspace, $(WORK)/, is untouched (python -m ddp_course reset --help: starting over)"
