"""Fixtures and hooks only. The constants tests share and the ways they start processes are in
``tests/harness.py`` (tests import that module; pytest advises against importing a conftest)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import pytest
from harness import SHARED_DATA, TINY

from ddp_course.check.workspace import VAR as WORKSPACE_VAR

_CACHE = pytest.StashKey[str]()  # the session's XDG_CACHE_HOME (see pytest_configure)


def pytest_configure(config: pytest.Config) -> None:
    """Point the corpus at ../shared/data on development and CI machines (they have no network), and
    give the session a cache of its own.

    A real user's DDP_COURSE_DATA, if set, wins. This runs before any test module is imported, and
    before any notebook's kernel starts: kernels inherit this environment.

    The learner's workspace (``work/`` of the checkout, or the one ``$DDP_COURSE_WORK`` names) is never
    read or written: the session's is an empty folder of its own (``check.workspace.home`` takes it for
    code run from outside a folder of lesson notebooks, where grading records go).

    The cache (``XDG_CACHE_HOME``) starts empty, so what the course caches there (exercise 04's
    one-process reference) is computed once in the session, by this code, never read from an earlier
    session: lesson 04's grading cell computes it and the tests read it. A corpus already in the
    user's cache is read from there (DDP_COURSE_DATA) rather than downloaded again.
    """
    if "DDP_COURSE_DATA" not in os.environ:
        from ddp_course.data import SHAKESPEARE_FILE, cache_dir

        for folder in (SHARED_DATA, cache_dir()):
            if (folder / SHAKESPEARE_FILE).is_file():
                os.environ["DDP_COURSE_DATA"] = str(folder)
                break
    config.stash[_CACHE] = tempfile.mkdtemp(prefix="ddp_course_cache_")
    os.environ["XDG_CACHE_HOME"] = config.stash[_CACHE]
    os.environ[WORKSPACE_VAR] = os.path.join(config.stash[_CACHE], "work")
    _share_the_cores()


def _share_the_cores() -> None:
    """Give each pytest worker's jobs, notebook kernels and own torch ops their share of the cores.

    With two workers on two cores, a one-process job or a kernel would start two threads each, and an
    OpenMP thread waiting for a core the other worker's job holds spins: measured, a 150-step MiniGPT
    run took 17.6 CPU-seconds alone and 34 beside a 4-rank job, against 16.3 with one thread beside
    it. A job's own choice (``threads=``) and a user's setting win."""
    from ddp_course.dist import THREADS_VAR, cpu_count

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    share = str(max(1, cpu_count() // workers))
    if workers > 1:
        os.environ.setdefault(THREADS_VAR, share)  # jobs (dist.setup)
        os.environ.setdefault("OMP_NUM_THREADS", share)  # kernels and other processes that import torch
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # this worker's own torch ops


def pytest_unconfigure(config: pytest.Config) -> None:
    if _CACHE in config.stash:
        shutil.rmtree(config.stash[_CACHE], ignore_errors=True)


def pytest_sessionstart(session: pytest.Session) -> None:
    import notebook_runs

    notebook_runs.SESSION_START = time.time()  # only notebook runs made from now on are reused


def _turn(item: pytest.Item) -> tuple[int, int]:
    """When an item's file runs (``make test`` hands out whole files in this order, ``--no-loadscope-reorder``):
    the notebooks first, the later lessons (the longer ones) before the earlier; then the tests; last,
    the test files that read a notebook's run (``notebook_runs``), so that the notebook has finished it
    and they need not launch the same job again."""
    if item.path.suffix == ".ipynb":
        number = item.path.name.partition("_")[0]
        return 0, -int(number) if number.isdigit() else 0
    module = getattr(item, "module", None)
    return (2 if module is not None and "notebook_runs" in vars(module) else 1), 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the cells of executed notebooks (``make test``'s build/learner) ``slow``, and put the files in
    the order they should run (:func:`_turn`; a stable sort, so a notebook's cells stay in order).

    ``-m "not slow"`` then leaves out every notebook execution, the bulk of the suite's time.
    """
    items.sort(key=_turn)
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.slow)
    # A test that needs a GPU says so with a marker too, so that `-m cuda` / `-m multigpu` runs every one
    unmarked = [item.nodeid for item in items
                if any("CUDA GPU" in str(m.kwargs.get("reason", "")) and "needs" in str(m.kwargs.get("reason", ""))
                       for m in item.iter_markers("skipif"))
                and not any(item.iter_markers("cuda")) and not any(item.iter_markers("multigpu"))]
    if unmarked:
        raise pytest.UsageError("tests that skip without a CUDA GPU but carry no cuda/multigpu marker: "
                                + ", ".join(unmarked[:5]))


@pytest.fixture
def tiny() -> dict:
    """Overrides for a model small enough that a run takes a second or two on a CPU."""
    return dict(TINY)


@pytest.fixture
def one_thread():
    """Run the test's torch ops on one thread (restored afterwards).

    The tiny models gain nothing from a second thread, and OpenMP threads that spin while another
    process holds the other core make such tests many times slower.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
