"""The core never depends on lesson material, and nothing new lands beside the core.

The core (``ddp_course/{cli,config,data,model,dist,train,checkpoint,metrics,launch,paths,postmortem}.py``,
``ddp_course/parallel/`` and ``ddp_course/_postmortem/``) is what the lessons build on; lesson material (``ddp_course.course`` and
everything under it) builds on the core. An import the other way round would make every training
run load lesson code, and tie the core's behaviour to a lesson's. Checked three ways:

- statically: no import in a core module (or the package's ``__init__``, which every import of a
  core module runs) names lesson material -- at any depth (inside functions too), absolute or
  relative, or through ``importlib.import_module``;
- dynamically: a fresh interpreter that imports every core module has loaded no lesson module
  (this also catches what the static check cannot see, such as an import made by a core module's
  dependency);
- the package's top level holds only the expected modules, so a new lesson file cannot sit beside
  the core.

A new core module goes into ``CORE`` below; new lesson material goes under ``ddp_course/course/``.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest
from harness import ROOT, run_command

PACKAGE = ROOT / "ddp_course"
LESSONS = "ddp_course.course"
CORE = ("cli", "config", "data", "model", "dist", "train", "checkpoint", "metrics", "launch", "paths", "postmortem")
CORE_PACKAGES = ("parallel", "_postmortem")  # _postmortem: the start-up hook every rank of a job loads
ENTRY_POINTS = ("__init__", "__main__", "bench", "doctor")  # the command line, not the core
HARNESS_PACKAGES = ("check",)  # the grading harness: `python -m ddp_course check`, one module per concern
TOP_LEVEL = {*(f"{m}.py" for m in (*CORE, *ENTRY_POINTS)), *CORE_PACKAGES, *HARNESS_PACKAGES, "course"}


def module_name(path: Path) -> str:
    """The dotted name of a file of the package: ddp_course/parallel/ddp.py -> ddp_course.parallel.ddp."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def core_files() -> list[Path]:
    """Every file of the core, and the package's __init__ (run by any import of a core module)."""
    files = [PACKAGE / "__init__.py", *(PACKAGE / f"{m}.py" for m in CORE)]
    for pkg in CORE_PACKAGES:
        files += sorted((PACKAGE / pkg).rglob("*.py"))
    return files


def is_lesson(name: str) -> bool:
    return name == LESSONS or name.startswith(LESSONS + ".")


def _absolute_in(node: ast.ImportFrom, module: str, is_pkg: bool) -> str:
    """The module a ``from X import ...`` in ``module`` reads, with a relative X resolved."""
    if not node.level:
        return node.module or ""
    parts = module.split(".") if is_pkg else module.split(".")[:-1]
    base = parts[:len(parts) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _called_name(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _loaders(tree: ast.AST) -> set[str]:
    """The names a module calls ``importlib.import_module`` or ``__import__`` by, aliases included
    (``from importlib import import_module as load``, ``load = importlib.import_module``)."""
    names = {"import_module", "__import__"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "importlib":
            names |= {a.asname or a.name for a in node.names if a.name == "import_module"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and _called_name(node.value) in names:
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _dynamic(arg: ast.AST, module: str, is_pkg: bool) -> str | None:
    """The module an ``import_module`` argument names: the string itself; for a name built at run time
    (``f"{__name__}.{name}"``, ``"ddp_course.course." + name``) its package, as ``pkg.*``."""
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    parts = arg.values if isinstance(arg, ast.JoinedStr) else [arg.left] if isinstance(arg, ast.BinOp) else []
    prefix = ""
    for part in parts:
        if isinstance(part, ast.Constant) and isinstance(part.value, str):
            prefix += part.value
        elif isinstance(part, ast.FormattedValue) and getattr(part.value, "id", "") in ("__name__", "__package__"):
            prefix += module if is_pkg or part.value.id == "__package__" else module.rsplit(".", 1)[0]
        else:
            break
    return f"{prefix.rsplit('.', 1)[0]}.*" if "." in prefix else None


MODULE_STRING = re.compile(r"^ddp_course(?:\.\w+)+$")


def _docstrings(tree: ast.AST) -> set[int]:
    return {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def _dotted(node: ast.AST, bound: dict[str, str]) -> str | None:
    """``a.b.c`` with ``a`` replaced by the module it is bound to, or None."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value, bound)):
        return f"{base}.{node.attr}"
    return None


def _aliases(tree: ast.AST, module: str, is_pkg: bool) -> dict[str, str]:
    """{local name: what it holds, dotted} for every name an import binds, or an assignment of one."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound.update({a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0]
                          for a in node.names})
        elif isinstance(node, ast.ImportFrom):
            base = _absolute_in(node, module, is_pkg)
            bound.update({a.asname or a.name: f"{base}.{a.name}" for a in node.names})
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and (target := _dotted(node.value, bound)):
            bound.update({t.id: target for t in node.targets if isinstance(t, ast.Name)})
    return bound


def module_edges(source: str, module: str, is_pkg: bool) -> list[tuple[int, str]]:
    """(line, name) for every module ``source`` may reach: its imports, in functions and branches too
    (``from M import n`` gives M and M.n: n may be a module); ``import_module`` / ``__import__`` under
    any alias (a name built at run time gives its package as ``pkg.*``); module names held as strings
    (a job launched as ``"ddp_course.course.l05_inside_ddp.ddp_internals"``; docstrings aside); and the
    attributes of an imported module or of an alias of one (``parallel.fsdp``, ``lab = parallel.fsdp``).
    A name that is not a module (``M.n`` for a function n) is sorted out by the caller."""
    tree = ast.parse(source)
    loaders, docs, bound = _loaders(tree), _docstrings(tree), _aliases(tree, module, is_pkg)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # a.b of a.b.c
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        names: list[str | None] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute_in(node, module, is_pkg)
            names = [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and node.args and _called_name(node.func) in loaders:
            names = [_dynamic(node.args[0], module, is_pkg)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            names = [node.value] if MODULE_STRING.match(node.value) else []
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and id(node) not in inner:
            names = [_dotted(node, bound)]
        found += [(node.lineno, n) for n in names if n]
    return found


def imported_names(source: str, path: Path) -> list[tuple[int, str]]:
    """(line, module name) for every module the file ``path`` may reach (:func:`module_edges`)."""
    return module_edges(source, module_name(path), path.name == "__init__.py")


def lesson_imports(source: str, path: Path) -> list[str]:
    """``line N: module`` for each lesson module that ``source`` (the text of ``path``) imports."""
    return [f"line {line}: {name}" for line, name in imported_names(source, path) if is_lesson(name)]


# --- the checker itself sees every form of import --------------------------------------------------------

@pytest.mark.parametrize("source, where", [
    ("import ddp_course.course.plots", "metrics.py"),
    ("import ddp_course.course as c", "metrics.py"),
    ("from ddp_course.course.plots import loss_curves", "metrics.py"),
    ("from ddp_course import course", "metrics.py"),
    ("from .course import plots", "metrics.py"),
    ("from . import course", "metrics.py"),
    ("from ..course.plots import loss_curves", "parallel/ddp.py"),
    ("from .. import course", "parallel/ddp.py"),
    ("from ..course import plots", "parallel/__init__.py"),
    ("def f():\n    if True:\n        from ddp_course.course import plots\n", "train.py"),
    ("import importlib\nimportlib.import_module('ddp_course.course.plots')", "launch.py"),
    ("from importlib import import_module as load\nload('ddp_course.course.plots')", "launch.py"),
    ("import importlib\nget = importlib.import_module\nget(f'ddp_course.course.{name}')", "launch.py"),
    ("import importlib\nimportlib.import_module('ddp_course.course.' + name)", "launch.py"),
    ("x = 'ddp_course.course.plots'", "train.py"),  # a module named in a string: a job launched by name
    ("run('ddp_course.course.l05_inside_ddp.ddp_internals', nproc=2)", "launch.py"),
    ("import ddp_course as pkg\nlab = pkg.course\nlab.plots.loss_curves()", "train.py"),  # an alias of a module
])
def test_the_scan_finds_a_lesson_import_in_any_form(source, where):
    assert lesson_imports(source, PACKAGE / where), imported_names(source, PACKAGE / where)


@pytest.mark.parametrize("source, where", [
    ("from ddp_course import config, parallel", "train.py"),
    ("from . import config", "metrics.py"),
    ("from .ddp import wrap", "parallel/__init__.py"),
    ("from .. import config", "parallel/ddp.py"),
    ("import ddp_course.courseware", "train.py"),
    ('"""Lesson 05 launches ddp_course.course.l05_inside_ddp.ddp_internals."""', "train.py"),  # a docstring
    ("x = 'python -m ddp_course.train --strategy=ddp'", "launch.py"),  # a command line, of the core
])
def test_the_scan_passes_core_imports(source, where):
    assert lesson_imports(source, PACKAGE / where) == []


def test_the_scan_sees_a_strategy_loaded_by_a_name_built_at_run_time():
    edges = module_edges("import importlib\nimportlib.import_module(f'{__name__}.{name}')", "ddp_course.parallel", True)
    assert [e for e in edges if e[1].startswith("ddp_course")] == [(2, "ddp_course.parallel.*")]
    assert module_edges("from ddp_course.parallel import fsdp\nfsdp.wrap", "ddp_course.parallel.fsdp1", False) == [
        (1, "ddp_course.parallel.fsdp"), (2, "ddp_course.parallel.fsdp.wrap")]


# --- the core itself ---------------------------------------------------------------------------------------

def test_every_core_module_exists():
    missing = [str(p.relative_to(ROOT)) for p in core_files() if not p.is_file()]
    assert not missing, f"core modules missing (renamed? update CORE in this test): {missing}"


@pytest.mark.parametrize("path", core_files(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_core_module_imports_no_lesson_material(path):
    found = lesson_imports(path.read_text(), path)
    assert not found, (f"{path.relative_to(ROOT)} imports lesson material {found}: the core must not depend on "
                       f"{LESSONS}. Move what it needs into the core, or the code that needs it into the lesson.")


CORE_TESTS = sorted(p for p in (ROOT / "tests" / "core").glob("test_*.py") if p.name != "test_architecture.py")


@pytest.mark.parametrize("path", CORE_TESTS, ids=lambda p: p.name)
def test_a_core_test_reaches_no_lesson_material(path):
    """tests/core tests the core and the harnesses; a lesson's labs, benchmarks and graders are tested in
    tests/lessons (test_<topic>.py) and tests/exercises (this file names lesson modules only as probes)."""
    found = lesson_imports(path.read_text(encoding="utf-8"), path)
    assert not found, f"tests/core/{path.name} reaches lesson material {found}: move that test to tests/lessons."


def test_importing_the_core_loads_no_lesson_module():
    names = sorted(module_name(p) for p in core_files())
    code = ("import importlib, json, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m == {LESSONS!r} or m.startswith({LESSONS + '.'!r}))))\n")
    proc = run_command([sys.executable, "-c", code], timeout=120)
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing the core loaded lesson modules: {loaded}"


def _holds_files(path: Path) -> bool:
    """Whether a folder holds anything but bytecode caches (a folder left with only __pycache__ after
    a move is not part of the package)."""
    return any(p.is_file() for p in path.rglob("*") if "__pycache__" not in p.parts)


def test_package_top_level_holds_only_the_expected_modules():
    found = {p.name for p in PACKAGE.iterdir()
             if not p.name.startswith(".") and p.name != "__pycache__" and (p.is_file() or _holds_files(p))}
    assert found - TOP_LEVEL == set(), (
        f"unexpected at the top of ddp_course/: {sorted(found - TOP_LEVEL)}. Lesson material goes under "
        "ddp_course/course/lNN_<topic>/ (shared figures in course/plots.py); a new core module is added to "
        "CORE in tests/core/test_architecture.py.")
    assert TOP_LEVEL - found == set(), f"missing from ddp_course/: {sorted(TOP_LEVEL - found)}"


# --- lessons in order ------------------------------------------------------------------------------------
# A lesson's modules (and its exercise scripts) import the core, the harnesses, the helpers several lessons
# share (ddp_course/course/*.py: plots, noise, tiny, options) and earlier lessons only: never a later one,
# which a learner meets after.

LESSON_RE = __import__("re").compile(r"^ddp_course\.course\.l(\d\d)_")


def later_lesson_imports(source: str, path: Path, lesson: int) -> list[str]:
    """``line N: module`` for each import in ``source`` of a lesson numbered after ``lesson``."""
    found = []
    for line, name in imported_names(source, path):
        m = LESSON_RE.match(name)
        if m and int(m.group(1)) > lesson:
            found.append(f"line {line}: {name}")
    return found


def lesson_files() -> list[tuple[Path, int]]:
    files = [(p, int(p.relative_to(PACKAGE / "course").parts[0][1:3]))
             for p in sorted((PACKAGE / "course").glob("l[0-9][0-9]_*/**/*.py"))]
    files += [(p, int(p.name[:2])) for p in sorted((ROOT / "solutions" / "exercises").glob("[0-9][0-9]_*.py"))]
    return files


# A later lesson's program that an earlier lesson's file launches by name (never imports), each with why the
# learner does not meet the later lesson early.
LAUNCHES_LATER = {
    ("ddp_course/course/l04_ddp/bench_clean_exit.py", "ddp_course.course.l05_inside_ddp.ddp_profile"):
        "the exit guard's stress check launches lesson 05's profiler among the jobs whose exit it counts; a "
        "maintainer runs it after a PyTorch upgrade (python -m ddp_course.bench clean_exit), a learner never does",
}


def test_a_lesson_imports_no_later_lesson():
    bad = {f"{p.relative_to(ROOT)} (lesson {n:02d})": later
           for p, n in lesson_files()
           if (later := [e for e in later_lesson_imports(p.read_text(encoding="utf-8"), p, n)
                         if (str(p.relative_to(ROOT)), e.split(": ")[1]) not in LAUNCHES_LATER])}
    assert not bad, ("a lesson imports a later one; move what both need to ddp_course/course/ (as tiny.py, "
                     f"plots.py, noise.py): {bad}")


def test_each_declared_launch_of_a_later_lesson_is_a_name_and_is_still_there():
    for (path, module), why in LAUNCHES_LATER.items():
        source = (ROOT / path).read_text(encoding="utf-8")
        assert f'"{module}"' in source and why, (path, module)  # launched by its name, and said why
        imports = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert not any(module in ast.unparse(n) for n in imports), f"{path} imports {module}: declare no import"


def test_the_order_check_finds_a_backward_import():
    grader = PACKAGE / "course" / "l05_inside_ddp" / "grader.py"
    backward = "def f():\n    from ddp_course.course.l06_grad_accumulation.no_sync_lab import tiny_model\n"
    assert later_lesson_imports(backward, grader, 5) == [
        "line 2: ddp_course.course.l06_grad_accumulation.no_sync_lab.tiny_model"]
    assert later_lesson_imports("from ddp_course.course.l02_collectives import bench_allreduce", grader, 5) == []
    assert later_lesson_imports("from ddp_course.course import tiny", grader, 5) == []


# --- a strategy is its own module: nothing asks a model which wrapper it is ---------------------------------

STRATEGY_USERS = ("train.py", "checkpoint.py", "launch.py", "parallel/__init__.py")
MODEL_NAMES = {"model", "wrapped", "ddp", "module", "m"}


def attribute_probes(source: str) -> list[str]:
    """``line N: hasattr(model, ...)`` for each hasattr/getattr on a variable that holds a model."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("hasattr", "getattr")
                and node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in MODEL_NAMES):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_the_probe_scan_finds_a_strategy_decided_by_an_attribute():
    assert attribute_probes("if hasattr(model, 'no_sync'):\n    pass\nn = len(getattr(model, 'device_ids', []))") == [
        "line 1: hasattr(model, 'no_sync')", "line 3: getattr(model, 'device_ids', [])"]


@pytest.mark.parametrize("where", STRATEGY_USERS)
def test_no_strategy_behaviour_is_decided_by_probing_the_model(where):
    """What differs between strategies (optimizer, no_sync, clipping, state dicts, process group, ...)
    is each strategy's own hook in ``ddp_course/parallel/<name>.py`` (``parallel.Strategy``), so that a
    new strategy is one new file; the loop, checkpoints and the launcher never probe a wrapped model."""
    found = attribute_probes((PACKAGE / where).read_text())
    assert not found, f"{where} decides by the model's attributes: {found}; give the strategy a hook instead."


def attribute_writes(source: str) -> list[str]:
    """``line N: model.x = ...`` for each attribute set on a variable that holds a model (``setattr`` too)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id in MODEL_NAMES:
                found.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return found


def test_the_write_scan_finds_state_parked_on_a_model():
    assert attribute_writes("model._tp_size = 2\nwrapped.param_ndims: dict = {}\nsetattr(m, 'n', 1)\nself.x = 1") == [
        "line 1: model._tp_size = 2", "line 2: wrapped.param_ndims: dict = {}", "line 3: setattr(m, 'n', 1)"]


@pytest.mark.parametrize("path", sorted((PACKAGE / "parallel").glob("*.py")), ids=lambda p: p.name)
def test_no_strategy_keeps_its_state_on_the_model(path):
    """What a strategy learns while wrapping and needs later (FSDP x TP's tensor-parallel size, FSDP1's
    parameter dimensions) is kept by its plan (a hook's keyword-only ``state``), never set on the model:
    a model carries no job's state, and the plan is the one object a job builds and hands on."""
    found = attribute_writes(path.read_text(encoding="utf-8"))
    assert not found, f"ddp_course/parallel/{path.name} sets attributes on a model: {found}; keep them in the plan's state."


def test_a_plan_is_one_jobs_and_wraps_one_model():
    """``parallel.plan_for`` builds a fresh plan per job, with a state of its own; the plan that wrapped a
    model is the one ``strategy_of`` finds, and it refuses to wrap a second model."""
    import torch.nn as nn

    from ddp_course import parallel
    from ddp_course.config import TrainConfig
    from ddp_course.dist import DistInfo

    cfg = TrainConfig(strategy="single")
    plan, other = parallel.plan_for(cfg), parallel.plan_for(cfg)
    assert plan is not other and plan.state is not other.state
    model = plan.wrap(nn.Linear(2, 2), DistInfo(), cfg)
    assert parallel.strategy_of(model) is plan
    with pytest.raises(RuntimeError, match=r"has wrapped a model already: a plan is one job's"):
        plan.wrap(nn.Linear(2, 2), DistInfo(), cfg)


def test_checkpoint_is_handed_its_plan_and_never_looks_it_up():
    """The training job holds its strategy and hands it to ``checkpoint`` (``plan=``, or the plan inside the
    ``TrainState`` that save and resume take; required wherever it is taken: no default to fall back on):
    checkpoint does not import ``parallel``, so it cannot climb back into it (``test_every_strategy``
    shows the job never looks its plan up again)."""
    tree = ast.parse((PACKAGE / "checkpoint.py").read_text(encoding="utf-8"))
    imported = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                and "parallel" in ast.unparse(n)]
    assert imported == [], imported
    functions = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name[0] != "_"}
    taking = {name: default for name, f in functions.items()
              for arg, default in zip(f.args.kwonlyargs, f.args.kw_defaults) if arg.arg == "plan"}
    assert {"save_final", "fingerprint"} <= taking.keys(), taking
    assert [name for name, default in taking.items() if default is not None] == []
    for name in ("save", "resume"):  # the plan travels in the job's state
        assert [ast.unparse(a.annotation) for a in functions[name].args.args if a.arg == "state"] == ["TrainState"]
    state = next(c for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name == "TrainState")
    fields = {ast.unparse(f.target): f.value for f in state.body if isinstance(f, ast.AnnAssign)}
    assert "plan" in fields and fields["plan"] is None  # no default


# --- the grading harness: split by concern, and nothing in the package runs a file by its path -------------

CHECK_PART_LINES = 320  # "each part under ~300 lines": a part that outgrows this is doing two jobs


@pytest.mark.parametrize("path", sorted((PACKAGE / "check").glob("*.py")), ids=lambda p: p.name)
def test_each_part_of_the_grading_harness_is_small(path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= CHECK_PART_LINES, f"ddp_course/check/{path.name} has {n} lines: split it by concern."


def test_no_course_module_loads_a_file_of_the_repository_by_its_path():
    """Import analysis (and a maintainer) must see what the package runs: no module of ours is executed
    from a path. Graders load the *learner's* script by path (that is their job), and the start-up hook
    chains to a ``sitecustomize`` it shadows; both name the file they load from their argument."""
    allowed = {"course/l08_checkpointing/grader.py", "course/l09_fsdp/grader_zero1.py", "course/l09_fsdp/grader_my_fsdp.py",
               "_postmortem/sitecustomize.py"}
    found = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
             if any(call in p.read_text(encoding="utf-8") for call in ("spec_from_file_location(", "run_path("))]
    assert sorted(set(found) - allowed) == [], found


# --------------------------------------------------------------------------------------------------
# A program of the course that pins the CPU on every machine says why (``dist.setup(..., because=...)``,
# printed in its first line); the exercise scripts run on the CPU by the course's design and are not
# programs of the package.

def cpu_pins_without_a_reason(source: str) -> list[int]:
    """Lines of ``setup(device="cpu", ...)`` calls that give no ``because``."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "setup"
            and any(k.arg == "device" and isinstance(k.value, ast.Constant) and k.value.value == "cpu"
                    for k in node.keywords)
            and not any(k.arg == "because" for k in node.keywords)]


def test_every_program_that_pins_the_cpu_says_why():
    found = [f"{p.relative_to(ROOT)}:{line}" for p in sorted(PACKAGE.rglob("*.py"))
             for line in cpu_pins_without_a_reason(p.read_text())]
    assert not found, "setup(device='cpu') without because=... (say why this program stays on the CPU): " + ", ".join(found)


def test_the_cpu_pin_scan_sees_a_missing_reason():
    assert cpu_pins_without_a_reason('with setup(device="cpu", timeout_s=3) as info:\n    pass') == [1]
    assert not cpu_pins_without_a_reason('with setup(device="cpu", because="gloo timeouts") as info:\n    pass')
    assert not cpu_pins_without_a_reason('with setup(device=opts["device"]) as info:\n    pass')


# --- the recipes of docs/ARCHITECTURE.md ("Where new things go") name files that exist ---------------------

RECIPE_PATH = __import__("re").compile(r"`((?:ddp_course|solutions|lessons|tests|tools|docs)/[^`\s]*?)(?:::\w+)?`")


def recipe_paths(text: str) -> list[str]:
    """The repository paths a recipe names, with ``NN``, ``<topic>`` and ``<name>`` left as they are."""
    section = text.split("## Where new things go", 1)[1].split("\n## ", 1)[0]
    return sorted(set(RECIPE_PATH.findall(section)))


def _exists(path: str) -> bool:
    """A concrete path exists; one with a placeholder has at least one instance (``NN`` two digits,
    ``<x>`` any name), e.g. ``tests/exercises/test_exercise_NN.py`` -> test_exercise_13.py."""
    import fnmatch
    import re

    if "NN" not in path and "<" not in path:
        return (ROOT / path).exists()
    pattern = re.sub(r"<[^>]+>", "*", path.replace("NN", "[0-9][0-9]"))
    parts = pattern.split("/")
    found = [ROOT]
    for part in parts:
        found = [c for d in found if d.is_dir() for c in d.iterdir() if fnmatch.fnmatch(c.name, part)]
    return bool(found)


def test_every_file_a_recipe_names_exists():
    paths = recipe_paths((ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8"))
    assert len(paths) >= 10, paths  # the recipes name their files: the scan must find them
    missing = [p for p in paths if not _exists(p)]
    assert not missing, f"docs/ARCHITECTURE.md's recipes name files that do not exist: {missing}"


def test_the_recipe_scan_sees_a_wrong_name():
    text = "## Where new things go\n- put it in `ddp_course/course/lNN_<topic>/grader.py` and `tests/lessons/test_nothing_here.py`\n## Rules"
    assert recipe_paths(text) == ["ddp_course/course/lNN_<topic>/grader.py", "tests/lessons/test_nothing_here.py"]
    assert _exists("ddp_course/course/lNN_<topic>/grader.py") and not _exists("tests/lessons/test_nothing_here.py")


# --- no import cycle anywhere in the package ---------------------------------------------------------------------
# Every import counts, inside a function too: ``from ddp_course.x import y`` is an edge to ``x.y`` when that
# is a module, else to ``x``. (Importing ``a.b`` also runs ``a/__init__``; that implied edge is left out, so
# that a package's ``__init__`` may gather its parts' public names.)


def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: the package modules it reaches (:func:`module_edges`)}, from {module: (source, is a
    package's __init__)}; ``pkg.*`` (a module loaded by a name built at run time) is every module of pkg."""
    graph: dict[str, set[str]] = {}

    def known(name: str) -> str:
        while name not in sources and "." in name:
            name = name.rsplit(".", 1)[0]
        return name

    for mod, (source, is_pkg) in sources.items():
        edges = set()
        for _, name in module_edges(source, mod, is_pkg):
            if name.endswith(".*"):
                edges |= {m for m in sources if m.startswith(name[:-1])}
            elif name.split(".")[0] == "ddp_course":
                edges.add(known(name))
        graph[mod] = edges - {mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another, directly or through others (Tarjan's components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v] & graph.keys():
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_anywhere_in_the_package():
    sources = {module_name(p): (p.read_text(encoding="utf-8"), p.name == "__init__.py") for p in PACKAGE.rglob("*.py")}
    graph = import_graph(sources)
    assert len(graph) > 100 and "ddp_course.check.registry" in graph["ddp_course.check.progress"]
    assert not cycles(graph), f"modules that import one another: {cycles(graph)}"


# The core's imports of course modules, as docs/ARCHITECTURE.md states them ("Import rules"), module by module
DOCUMENTED_EDGES = {
    "cli": set(), "data": set(), "dist": set(), "metrics": set(), "paths": set(),
    "config": {"cli"}, "model": {"config"}, "checkpoint": {"dist"}, "postmortem": {"paths"},
    "launch": {"config", "data", "dist", "metrics", "parallel", "paths", "postmortem", "train"},  # train: by name
    "_postmortem.sitecustomize": set(),  # the start-up hook every rank loads
}


def test_the_core_imports_what_the_architecture_document_says():
    sources = {module_name(p): (p.read_text(encoding="utf-8"), p.name == "__init__.py") for p in PACKAGE.rglob("*.py")}
    graph = {m.removeprefix("ddp_course."): {e.removeprefix("ddp_course.") for e in edges}
             for m, edges in import_graph(sources).items()}
    assert {m: graph[m] for m in DOCUMENTED_EDGES} == DOCUMENTED_EDGES
    # parallel's __init__: config, dist, checkpoint, and every module of its own (a strategy loaded by name)
    strategies = [m for m in graph if m.startswith("parallel.")]
    assert len(strategies) >= 10
    assert graph["parallel"] == {"config", "dist", "checkpoint", *strategies}
    # a strategy (or helper) imports config, dist, model and the package's other modules, never its __init__
    for m in strategies:
        assert graph[m] <= {"config", "dist", "model"} | {s for s in strategies if s != m}, (m, graph[m])
    assert {m for m in strategies if "model" in graph[m]} >= {"parallel.fsdp"}
    assert all("parallel.fsdp" in graph[f"parallel.{m}"] for m in ("fsdp_tp", "pipeline", "fsdp1"))
    assert all("parallel._optimizer" in graph[f"parallel.{m}"] for m in ("fsdp1", "zero1"))
    # config reads the strategies' files as text: it imports no torch (and no parallel, above)
    config = ast.parse((PACKAGE / "config.py").read_text(encoding="utf-8"))
    assert not [n for n in ast.walk(config) if isinstance(n, (ast.Import, ast.ImportFrom))
                and "torch" in ast.unparse(n)]


def private_imports(source: str, package: str) -> list[str]:
    """The private names (``_x``) that ``source`` imports from the modules of ``package``."""
    return [f"{node.module}.{a.name}" for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package)
            for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]


def test_the_grading_harness_shares_no_private_name_between_its_modules():
    found = {p.name: private_imports(p.read_text(encoding="utf-8"), "ddp_course.check")
             for p in (PACKAGE / "check").glob("*.py")}
    assert not {k: v for k, v in found.items() if v}, found
    assert private_imports("from ddp_course.check.registry import RECORDS, _key\n", "ddp_course.check") == \
        ["ddp_course.check.registry._key"]  # the scan sees one


def test_the_cycle_scan_finds_a_cycle_through_a_function_level_import():
    sources = {"ddp_course.a": ("from ddp_course import b\n", False),
               "ddp_course.b": ("def f():\n    from ddp_course.c import x\n", False),
               "ddp_course.c": ("from . import a\nx = 1\n", False),
               "ddp_course.d": ("import ddp_course.a\n", False)}
    assert cycles(import_graph(sources)) == [["ddp_course.a", "ddp_course.b", "ddp_course.c"]]


def test_the_cycle_scan_sees_a_strategy_that_imports_the_package_loading_it():
    """``parallel/__init__`` loads each strategy by a name built at run time; a strategy that imports the
    package's ``__init__`` back (as zero1 and fsdp1 did for the default optimizer) closes a loop."""
    sources = {"ddp_course.parallel": ("import importlib\ndef get(n):\n    importlib.import_module(f'{__name__}.{n}')\n"
                                       "from ddp_course.parallel._optimizer import adamw\n", True),
               "ddp_course.parallel._optimizer": ("", False),
               "ddp_course.parallel.zero1": ("from ddp_course.parallel import adamw\n", False),
               "ddp_course.parallel.fsdp1": ("from ddp_course.parallel import _optimizer\n", False)}
    assert cycles(import_graph(sources)) == [["ddp_course.parallel", "ddp_course.parallel.zero1"]]
    launched = {"ddp_course.a": ("run('ddp_course.b', nproc=2)\n", False), "ddp_course.b": ("import ddp_course.a\n", False)}
    assert cycles(import_graph(launched)) == [["ddp_course.a", "ddp_course.b"]]  # a job launched by name counts
