"""Benchmarks: speed claims of the course, measured rather than asserted.

    python -m ddp_course.bench                      list the benchmarks
    python -m ddp_course.bench NAME --help          the options of one benchmark
    python -m ddp_course.bench overhead --n_layer=4 --rounds=9 --out=/tmp/bench
    python -m ddp_course.bench clean_exit --launches=200   do finished jobs exit 0? (run after a torch upgrade)

Every benchmark is a module ``ddp_course/course/lNN_<topic>/bench_NAME.py`` that registers one
function with :func:`bench`; this file is the harness they share: the options (``--key=value``,
parsed by :func:`ddp_course.cli.parse_flags`; unknown keys are refused), ``--help``, the result
file ``<out>/<name>.json`` (written atomically, always with the options, the versions and the load
average), the noise warning, :class:`BenchError`, and starting jobs (:func:`launch`).
``--out`` defaults to ``bench_results``. Speed targets live in the benchmarks, not in the timed
tests: machines differ, and a benchmark reports its own noise.

From Python: ``from ddp_course import bench; bench.run("overhead", rounds=3)`` returns the result.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_course.cli import GRAMMAR, FlagError, number_list, parse_flags
from ddp_course.paths import show

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the directory holding ddp_course/
# When repeats of one fixed amount of work are too far apart to be read: the one threshold of the course,
# for the benchmarks' warning (noise_warning) and the notebooks' verdicts (course/noise.disturbed).
# Repeats on a quiet machine stay within about 1.1-1.6x of each other (this course's benchmarks on 2- to
# 16-core machines), so a narrower limit would call quiet machines disturbed; beyond 3x, something else
# had most of the machine for part of the run.
DISTURBED_SPAN = 3.0


class BenchError(RuntimeError):
    """A benchmark cannot run or its result is not valid. The message says why."""


class OptionError(BenchError, FlagError):
    """A bad option of a benchmark, found before it starts: it exits 2, the course's answer to bad input."""


@dataclass(frozen=True)
class Bench:
    """One registered benchmark: ``run(opts) -> result``; ``check(opts)`` validates (and may convert)
    the parsed options before anything starts; ``worker(opts)`` is the entry point of the processes a
    benchmark launches of itself (``--worker=true``)."""

    name: str
    run: Callable[[dict[str, Any]], dict[str, Any]]
    defaults: dict[str, Any]
    help: dict[str, str]
    doc: str
    check: Callable[[dict[str, Any]], None] | None = None
    worker: Callable[[dict[str, Any]], None] | None = None


BENCHES: dict[str, Bench] = {}
COMMON = {"out": ("bench_results", "directory for <name>.json (and any run folders)")}
WORKER = {"worker": (False, "internal: run as one process of a job (set by the bench itself)"),
          "out_dir": ("", "internal: where a job's processes write their result")}


def bench(name: str, *, check: Callable | None = None, worker: Callable | None = None,
          **options: tuple[Any, str]) -> Callable:
    """Register ``fn`` as benchmark ``name``; options are ``key=(default, help)``.

    ``worker`` adds the internal options ``--worker`` and ``--out_dir``.
    """
    def register(fn: Callable) -> Callable:
        spec = {**options, **COMMON, **(WORKER if worker else {})}
        module_doc = (getattr(sys.modules.get(fn.__module__), "__doc__", None) or "").strip()
        fn_doc = inspect.cleandoc(fn.__doc__ or "")
        doc = module_doc if fn_doc in module_doc or "\n" not in fn_doc else f"{module_doc}\n\n{fn_doc}"
        BENCHES[name] = Bench(name, fn, {k: v[0] for k, v in spec.items()}, {k: v[1] for k, v in spec.items()},
                              doc, check, worker)
        return fn
    return register


# --------------------------------------------------------------------------------------------------
# finding benchmarks

def module_benches() -> dict[str, str]:
    """{name: module} for the benchmark modules ``ddp_course/course/lNN_<topic>/bench_NAME.py``."""
    from ddp_course.course import lesson_folders

    found = {}
    for pkg in lesson_folders().values():
        path = [str(Path(__file__).parent / "course" / pkg.rsplit(".", 1)[1])]
        for m in pkgutil.iter_modules(path):
            if m.name.startswith("bench_"):
                found[m.name[6:]] = f"{pkg}.{m.name}"
    return dict(sorted(found.items()))


def get(name: str) -> Bench:
    """The registered benchmark ``name``, importing its module first if need be."""
    modules = module_benches()
    if name not in BENCHES and name in modules:
        importlib.import_module(modules[name])
    if name not in BENCHES:
        raise OptionError(f"unknown benchmark {name!r}; choose one of {', '.join(modules)} "
                          "(`python -m ddp_course.bench --help`).")
    return BENCHES[name]


def _module_summary(module: str) -> str:
    """The first line of a module's docstring, read without importing it."""
    spec = importlib.util.find_spec(module)
    try:
        doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))) or ""
    except (OSError, SyntaxError, TypeError, AttributeError):
        doc = ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


# --------------------------------------------------------------------------------------------------
# options and help

def parse_options(b: Bench | str, argv: list[str]) -> dict[str, Any]:
    """``--key=value`` overrides of the benchmark's defaults, converted to each default's type and
    checked by the benchmark; raises :class:`OptionError`."""
    b = get(b) if isinstance(b, str) else b
    try:
        opts = parse_flags(argv, b.defaults, prog=f"python -m ddp_course.bench {b.name}")
        shared_checks(b, opts)
    except FlagError as exc:
        raise OptionError(str(exc)) from None
    if b.check is not None:
        b.check(opts)
    return opts


# A number whose help says what 0 means ("0: ...", "0 = ...") may be 0, as may an untimed warm-up; a
# seed may be any integer. A help that opens with choices ("rank0 | all | none: ...") or ends with a list
# ("comma-separated, from: train, profile") names every value the option takes.
_ZERO_MEANS = ("0:", "0 =", "(0", "untimed")
_CHOICES = re.compile(r"^([\w.]+(?: \| [\w.]+)+)(?=$|:|\s\()")
_FROM = re.compile(r"comma-separated, from: ([\w ,]+)$")


def shared_checks(b: Bench, opts: dict[str, Any]) -> None:
    """The checks every benchmark's options get before its own: an option named as a field of
    ``TrainConfig`` (``n_head``, ``device``, ``timeout_s``, ...) follows that field's rules; ``--device``
    must be one this machine has (``dist.choose_device``); ``--corpus`` must be one the course can read;
    a number is positive unless its help says what 0 means; a value is one of the choices its help
    names; ``--out`` names a folder. Raises FlagError."""
    import dataclasses

    from ddp_course.config import TrainConfig
    from ddp_course.data import CorpusError, check_corpus
    from ddp_course.dist import DeviceError, choose_device

    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    shared = {k: v for k, v in opts.items() if k in fields and type(v) is type(getattr(TrainConfig(), k))}
    TrainConfig(**shared).validate()  # ConfigError is a FlagError
    for key, value in opts.items():
        text = b.help.get(key, "")
        if text.startswith("internal:") or key == "seed" or value == b.defaults.get(key):
            continue  # a default is always one the benchmark takes
        if type(value) in (int, float):
            zero_ok = any(word in text for word in _ZERO_MEANS) and "at least 1" not in text
            if value < 0 or (value == 0 and not zero_ok):
                raise FlagError(f"--{key} must be {'0 or more' if zero_ok else 'positive'} (got {value}).")
        elif type(value) is str and (_CHOICES.match(text) or _FROM.search(text)):
            found = _CHOICES.match(text) or _FROM.search(text)
            allowed = [w.strip() for w in re.split(r"[|,]", found.group(1)) if w.strip()]
            given = [v.strip() for v in value.split(",")] if _FROM.search(text) else [value]
            wrong = [v for v in given if v not in allowed] or ([] if any(given) else [value])
            if wrong:
                raise FlagError(f"--{key}={value!r}: {wrong[0]!r} is not one of {', '.join(allowed)}.")
    if "device" in opts:
        try:
            choose_device(opts["device"], 1)
        except DeviceError as exc:
            raise FlagError(str(exc)) from None
    if "corpus" in opts:
        try:
            check_corpus(opts["corpus"])
        except CorpusError as exc:
            raise FlagError(str(exc)) from None
    if "out" in opts and not str(opts["out"]).strip():
        raise FlagError("--out must name a folder for the result, e.g. --out=bench_results.")


def usage(b: Bench | None = None) -> str:
    """The list of benchmarks, or one benchmark's description and options (internal ones left out)."""
    if b is None:
        lines = [__doc__.strip(), "", "benchmarks:"]
        lines += [f"  {name:<16} {_module_summary(mod)}" for name, mod in module_benches().items()]
        lines += ["", "options of one benchmark: python -m ddp_course.bench NAME --help"]
        return "\n".join(lines)
    lines = [f"usage: python -m ddp_course.bench {b.name} [--key=value ...]", "", b.doc, "", GRAMMAR, "",
             "options:"]
    lines += [f"  {f'--{k}={v}':<32} {b.help[k]}" for k, v in b.defaults.items() if not b.help[k].startswith("internal:")]
    return "\n".join(lines)


def positive(opts: dict[str, Any], *keys: str, least: int = 1) -> None:
    """Raise :class:`OptionError` unless every ``opts[key]`` is at least ``least``."""
    for key in keys:
        if opts[key] < least:
            word = "at least 1" if least == 1 else f"{least} or more"
            raise OptionError(f"--{key} must be {word} (got {opts[key]}).")


def int_list(opts: dict[str, Any], key: str, example: str = "1,2,4") -> list[int]:
    """``opts[key]`` ("1,2,4") as a list of integers; raises :class:`OptionError`."""
    try:
        return number_list(opts[key], key, int, example)
    except FlagError as exc:
        raise OptionError(str(exc)) from None


def float_list(opts: dict[str, Any], key: str, example: str = "25,0.1,0.05") -> list[float]:
    """``opts[key]`` ("25,0.1") as a list of positive numbers; raises :class:`OptionError`."""
    try:
        return number_list(opts[key], key, float, example)
    except FlagError as exc:
        raise OptionError(str(exc)) from None


def choice(opts: dict[str, Any], key: str, choices: tuple[str, ...]) -> None:
    """Raise :class:`OptionError` unless ``opts[key]`` is one of ``choices``."""
    if opts[key] not in choices:
        raise OptionError(f"--{key} must be {', '.join(choices[:-1])} or {choices[-1]} (got {opts[key]!r}).")


# --------------------------------------------------------------------------------------------------
# noise

def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float]) -> float:
    """(max - min) / median: how much a speed moved between rounds."""
    return (max(xs) - min(xs)) / median(xs) if xs else float("nan")


def span(xs: list[float]) -> float:
    """max / min of repeats of the same work (1.0 when they agree; inf when one is 0)."""
    return max(xs) / min(xs) if xs and min(xs) > 0 else float("inf")


def noise_warning(name: str, span_: float, advice: str, load: list[float] | None = None) -> bool:
    """Whether a result is disturbed: rounds of the same work whose :func:`span` is above
    :data:`DISTURBED_SPAN`, or (when ``load``, the load average at the start, is given) a machine busier
    than half its cores. Prints the one warning of the course's benchmarks when it is, with ``advice``
    on how to get a cleaner figure."""
    from ddp_course.metrics import load_average

    cores = os.cpu_count() or 1
    busy = span_ > DISTURBED_SPAN or (load is not None and load[0] > 0.5 * cores)
    if busy:
        print(f"warning: [{name}] speed varied {span_:.1f}x between rounds (load average "
              f"{load if load is not None else load_average()} on {cores} CPU(s)): other work shared the machine. "
              f"{advice}", flush=True)
    return busy


# --------------------------------------------------------------------------------------------------
# devices and jobs

def device_for(device: str, nproc: int) -> tuple[Any, str, str]:
    """:func:`ddp_course.dist.choose_device` for a job of ``nproc`` processes (what each of its ranks will
    choose); a device that cannot be had becomes :class:`BenchError`."""
    from ddp_course.dist import DeviceError, choose_device

    try:
        return choose_device(device, nproc)
    except DeviceError as exc:
        raise BenchError(str(exc)) from None


def study_device(device: str, sizes: list[int]) -> tuple[str, list[int], str]:
    """:func:`ddp_course.dist.choose_study_device`: one kind of device for every job of a benchmark, and
    the job sizes that fit on it; a device that cannot be had becomes :class:`BenchError`."""
    from ddp_course.dist import DeviceError, choose_study_device

    try:
        return choose_study_device(device, sizes)
    except DeviceError as exc:
        raise BenchError(str(exc)) from None


def study_start(tag: str, opts: dict[str, Any], sizes: str) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """A study's opening: the device for every job and the job sizes ``opts[sizes]`` that fit on it
    (:func:`study_device`), said in a ``[tag]`` line; returns (the output folder, the options with
    both settled, ``{"device_reason", "cpu_count"}`` for the result)."""
    from ddp_course.dist import cpu_count

    device, fitting, reason = study_device(opts["device"], opts[sizes])
    print(f"[{tag}] {reason}", flush=True)
    return Path(opts["out"]).resolve(), {**opts, "device": device, sizes: fitting}, {"device_reason": reason,
                                                                                      "cpu_count": cpu_count()}


def job_env(**extra: str) -> dict[str, str]:
    """Environment additions for a benchmark's job: it imports the same ``ddp_course`` as this process."""
    path = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, **extra}


def launch(module: str, nproc: int, *, what: str, timeout: float, out_dir: str | os.PathLike | None = None,
           use_torchrun: bool | None = None, env: dict[str, str] | None = None, echo: str = "none",
           **flags: Any):
    """Start a job with :func:`ddp_course.launch.run` (which stops all of it on timeout or Ctrl-C) and
    return its Run; a failure or a timeout becomes :class:`BenchError` naming ``what``."""
    from ddp_course.launch import LaunchError, LaunchTimeout, run

    try:
        return run(module, nproc, out_dir=out_dir, timeout=timeout, progress=False, echo=echo,
                   use_torchrun=use_torchrun, env=job_env(**(env or {})), **flags)
    except LaunchTimeout as exc:
        raise BenchError(f"{what} did not finish in {timeout:.0f}s (all its processes were stopped). "
                         f"Last lines of its output:\n{exc.run.output[-2000:]}") from None
    except LaunchError as exc:
        raise BenchError(f"{what} failed: {exc}") from None


def job_result(r, name: str = "worker.json") -> dict[str, Any]:
    """The JSON file ``name`` a finished job wrote into its folder; :class:`BenchError` when it is missing."""
    import json

    path = Path(r.out_dir) / name
    if not path.is_file():
        raise BenchError(f"the job `{r.module}` with {r.nproc} process(es) finished but wrote no {path}. "
                         f"Its output:\n{r.output[-2000:]}")
    return json.loads(path.read_text(encoding="utf-8"))


def worker_job(name: str, nproc: int, out_dir: Path, *, timeout: float, on_cpu: bool = True,
               use_torchrun: bool = True, **worker_opts: Any) -> tuple[dict[str, Any], Any, bool]:
    """Run benchmark ``name``'s own worker entry (``--worker=true``) on ``nproc`` processes in ``out_dir``.

    Returns ``(the worker.json it wrote, the Run, oversubscribed)``; ``oversubscribed`` is true when
    the processes' threads outnumber the cores (CPU only), and a note says that the times then
    include waiting for a core. ``worker_opts`` are the workers' options (``threads``: per process)."""
    from ddp_course.dist import cpu_count

    cores, threads = cpu_count(), int(worker_opts.get("threads", 1))
    oversubscribed = on_cpu and nproc * threads > cores
    if oversubscribed:
        print(f"[{name}] note: {nproc} processes x {threads} thread(s) on {cores} core(s) oversubscribe the CPU: "
              "they take turns on the cores, and the times include that waiting.", flush=True)
    (Path(out_dir) / "worker.json").unlink(missing_ok=True)
    r = launch(module_benches()[name], nproc, what=f"the job with {nproc} process(es)", timeout=timeout,
               out_dir=out_dir, use_torchrun=use_torchrun, worker=True, **worker_opts)
    return job_result(r), r, oversubscribed


# --------------------------------------------------------------------------------------------------
# running

def _execute(b: Bench, opts: dict[str, Any]) -> dict[str, Any]:
    """Run ``b`` with parsed options and write ``<out>/<name>.json``, with the options, the versions
    and the load average added where the benchmark did not record them itself."""
    from ddp_course.metrics import environment, load_average, write_json

    result = b.run(opts)
    result.setdefault("options", opts)
    result.setdefault("load_average", load_average())
    result.setdefault("environment", environment())
    path = Path(opts["out"]) / f"{b.name}.json"
    write_json(path, result)
    print(f"[{b.name}] wrote {show(path)}", flush=True)
    return result


def run(name: str, **overrides: Any) -> dict[str, Any]:
    """Run benchmark ``name`` from Python: ``run("overhead", rounds=3, steps=5)``. Returns its result."""
    b = get(name)
    overrides = {"echo": "none", **overrides} if b.defaults.get("echo") == "auto" else overrides
    return _execute(b, parse_options(b, [f"--{k}={v}" for k, v in overrides.items()]))


def main(argv: list[str] | None = None) -> int:
    """``python -m ddp_course.bench [NAME [--key=value ...]]``: 0 when done (and not FAIL), 1 on FAIL or
    when the benchmark cannot run, 2 on a bad option."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    try:
        b = get(argv[0])
    except OptionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rest = argv[1:]
    if any(a in ("-h", "--help") for a in rest):
        print(usage(b))
        return 0
    if b.defaults.get("echo") == "auto" and not any(a.split("=")[0] == "--echo" for a in rest):
        rest = ["--echo=rank0", *rest]  # on the command line, show the job's rank 0 as it runs
    try:
        opts = parse_options(b, rest)
    except OptionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        if opts.get("worker"):
            b.worker(opts)
            return 0
        result = _execute(b, opts)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 1 if result.get("pass") is False else 0


def entry_points(name: str) -> tuple[Callable[..., dict[str, Any]], Callable[[list[str] | None], int]]:
    """A benchmark module's ``(bench, main)``: ``bench(**overrides)`` is ``run(name, **overrides)``, and
    ``main(argv)`` (``python -m ddp_course.course.lNN_x.bench_NAME [...]``) is
    ``python -m ddp_course.bench NAME [...]``."""
    def bench_(**overrides: Any) -> dict[str, Any]:
        return run(name, **overrides)

    def main_(argv: list[str] | None = None) -> int:
        return main([name, *(sys.argv[1:] if argv is None else argv)])

    bench_.__doc__ = f"From Python: the {name} benchmark with ``--key=value`` overrides; returns its result."
    main_.__doc__ = f"``python -m ddp_course.bench {name} [--key=value ...]``."
    return bench_, main_


if __name__ == "__main__":  # run through the imported module: benchmarks register with that one
    from ddp_course.bench import main as _main

    sys.exit(_main())
