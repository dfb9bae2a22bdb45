"""Bad input, as new users typed it: one ``error: ...`` paragraph on stderr that says what to do, exit
code 2, never a traceback; ``--help`` on stdout with exit code 0; a warning (not a refusal) for more
processes than cores; and the same option forms in every command of the course.

Most checks run in this process (the parsers, ``python -m ddp_course run``'s ``main`` with a launcher
that starts nothing); a few start one cheap ``python -m`` child to see what a user sees, and one
torchrun job of two ranks that stop before joining a process group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from harness import TINY, python_module, torchrun

from ddp_course import __main__ as course_cli
from ddp_course import bench, config, launch, parallel, train
from ddp_course import dist as course_dist
from ddp_course.cli import FlagError, parse_flags, usage
from ddp_course.config import ConfigError, TrainConfig, available_strategies, parse_cli, to_cli

TINY_ARGS = to_cli({**TINY, "max_steps": 1})


def one_error_line(stderr: str) -> str:
    """The refusal a user sees: exactly one line, starting ``error: ``, and no traceback."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


@pytest.fixture
def no_torchrun(monkeypatch):
    """This process as a plain ``python -m`` one: none of the variables torchrun sets."""
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def launched(monkeypatch) -> list[dict]:
    """``launch.run`` replaced by one that starts nothing and records how it was called."""
    calls: list[dict] = []

    def fake_run(module: str, nproc: int = 2, **kw):
        calls.append({"module": module, "nproc": nproc, **kw})
        return "Run(fake)"

    monkeypatch.setattr(launch, "run", fake_run)
    return calls


# --- 1. a strategy that needs a process group, started without torchrun ---------------------------------

@pytest.mark.timeout(60)
def test_ddp_without_torchrun_is_one_error_line(tmp_path):
    proc = python_module("ddp_course.train", ["--strategy=ddp", *TINY_ARGS, f"--out_dir={tmp_path}"],
                         timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr)
    assert "needs a process group" in line and "torchrun --standalone --nproc_per_node=2" in line


@pytest.mark.parametrize("strategy", [n for n in available_strategies() if parallel.Strategy(n).needs_process_group])
def test_check_launch_and_wrap_refuse_a_group_strategy_in_one_plain_process_alike(strategy, no_torchrun, tmp_path):
    """One refusal (``Strategy.refusal``), whoever asks: the launch check before anything is built, or
    the strategy's wrap called by hand."""
    with pytest.raises(ConfigError) as by_launch:
        train.check_launch(TrainConfig(strategy=strategy, out_dir=str(tmp_path)))
    with pytest.raises(ConfigError) as by_wrap:
        parallel.wrap(torch.nn.Linear(2, 2), course_dist.DistInfo(), TrainConfig(strategy=strategy))
    assert str(by_launch.value) == str(by_wrap.value)
    assert f"--strategy={strategy} needs a process group" in str(by_wrap.value)
    assert "torchrun --standalone --nproc_per_node=" in str(by_wrap.value)


def test_check_launch_refuses_one_process_strategies_on_several_ranks(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="runs in one process, but this job has 2 ranks"):
        train.check_launch(TrainConfig(strategy="single", out_dir=str(tmp_path)))


# --- 2. python -m ddp_course run --nproc=<bad> ------------------------------------------------------------

@pytest.mark.timeout(60)
def test_run_with_a_bad_nproc_is_one_error_line():
    proc = python_module("ddp_course", ["run", "--nproc=abc"], timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "--nproc expects an integer" in one_error_line(proc.stderr)


@pytest.mark.parametrize("argv, words", [(["--nproc=0"], "at least 1 (got 0)"), (["--nproc=-3"], "at least 1 (got -3)"),
                                         (["--nproc=2.5"], "expects an integer"), (["--nproc"], "needs a value"),
                                         (["--nproc=1", "--nproc=2"], "given twice")])
def test_run_refuses_bad_nproc_before_launching(argv, words, launched, capsys):
    assert course_cli.main(["run", *argv]) == 2
    assert words in one_error_line(capsys.readouterr().err)
    assert launched == []


def test_run_turns_the_launchers_value_error_into_an_error_line(monkeypatch, capsys):
    def refuse(*a, **kw):
        raise ValueError("nproc must be at least 1 (got 0).")

    monkeypatch.setattr(launch, "run", refuse)
    assert course_cli.main(["run", "--max_steps=2"]) == 2
    assert one_error_line(capsys.readouterr().err) == "error: nproc must be at least 1 (got 0)."


# --- 3. an --out_dir that cannot be created ---------------------------------------------------------------

@pytest.mark.timeout(60)
def test_train_refuses_an_out_dir_under_a_file_before_training(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    proc = python_module("ddp_course.train", [*TINY_ARGS, f"--out_dir={blocker / 'run'}"], timeout=60, check=False)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr)
    assert f"--out_dir={blocker / 'run'} cannot be created" in line and "is a file, not a folder" in line
    assert "pass a folder you can write to" in line
    assert "step" not in proc.stdout  # refused before the first step


@pytest.mark.parametrize("where", ["under_a_file", "is_a_file", "proc"])
def test_check_out_dir_says_why(where, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    if where == "proc" and not Path("/proc/self").is_dir():
        pytest.skip("no /proc on this system")
    out_dir = {"under_a_file": blocker / "x" / "y", "is_a_file": blocker, "proc": Path("/proc/x")}[where]
    with pytest.raises(ConfigError, match=r"cannot be (created|written to): .*; pass a folder you can write to"):
        config.check_out_dir(str(out_dir))


def test_check_out_dir_creates_a_good_folder(tmp_path):
    config.check_out_dir(str(tmp_path / "new" / "run"))
    assert (tmp_path / "new" / "run").is_dir() and list((tmp_path / "new" / "run").iterdir()) == []


def test_run_refuses_an_out_dir_under_a_file_before_launching(tmp_path, launched, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    assert course_cli.main(["run", f"--out_dir={blocker / 'run'}"]) == 2
    assert "is a file, not a folder" in one_error_line(capsys.readouterr().err)
    assert launched == []


# --- 4. --help: stdout, exit code 0 ---------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_train_help_goes_to_stdout_and_exits_0():
    proc = python_module("ddp_course.train", ["--max_steps=3", "--help"], timeout=60, check=False)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.startswith("usage: python -m ddp_course.train") and "--max_steps=200" in proc.stdout


def test_run_help_lists_nproc_and_the_training_options(launched, capsys):
    assert course_cli.main(["run", "-h"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("usage: python -m ddp_course run") and "--nproc=1" in out
    assert "--max_steps=200" in out and launched == []


# --- 5. bad input under torchrun: one line, every rank exits 2 before joining the group --------------------

def test_check_launch_refuses_an_uneven_global_batch_before_any_process_group(monkeypatch, tmp_path):
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = TrainConfig(strategy="ddp", global_batch_size=33, micro_batch_size=4, out_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="--global_batch_size=33 does not divide"):
        train.check_launch(cfg)
    assert not dist.is_initialized()


@pytest.mark.timeout(120)
def test_torchrun_refusal_is_one_line_and_no_rank_crashes(tmp_path):
    """What torchrun prints around it cannot be removed from a worker (see ``ddp_course.train.cli``)."""
    proc = torchrun("ddp_course.train", 2, ["--strategy=single", *TINY_ARGS, f"--out_dir={tmp_path}"],
                    timeout=120, check=False)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and "--strategy=single runs in one process" in errors[0], proc.stderr
    # every rank refuses with 2, but torchrun stops the others (SIGTERM) as soon as the first one exits,
    # so a rank may show -15 instead: what must never show is a crash (exit code 1)
    assert proc.stderr.count("exitcode  : 2") >= 1 and "exitcode  : 1 " not in proc.stderr, proc.stderr
    assert proc.stderr.count("Traceback") <= 1, proc.stderr  # only torchrun's own (ChildFailedError), no rank's
    assert proc.returncode == 1  # torchrun's exit code for any failed worker


SLOW_RANK_0 = """import os, time
if os.environ.get("RANK") == "0":
    time.sleep(3.0)  # rank 0 starts 3 s after the others, as on a loaded machine
from ddp_course.train import cli
cli()
"""


@pytest.mark.timeout(120)
def test_the_refusal_is_printed_when_rank_0_starts_last(tmp_path):
    """Every rank refuses; only rank 0 prints. A rank that exited first let torchrun stop rank 0 before it
    printed (no line at all, measured with rank 0 starting 3 s late): the others wait for it."""
    (tmp_path / "slow_rank_0.py").write_text(SLOW_RANK_0)
    proc = torchrun("slow_rank_0", 2, ["--strategy=single", *TINY_ARGS, f"--out_dir={tmp_path / 'out'}"],
                    timeout=120, check=False, env={"PYTHONPATH": str(tmp_path)})
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert errors == [errors[0]] and errors[0].startswith("error: --strategy=single runs in one process"), proc.stderr
    assert "exitcode  : 1 " not in proc.stderr and proc.returncode == 1, proc.stderr


# --- 6. more processes than cores: a warning, not a refusal ------------------------------------------------

def test_oversubscription_warning_says_what_it_costs():
    assert course_cli.oversubscription(2, 2) is None and course_cli.oversubscription(1, 16) is None
    text = course_cli.oversubscription(64, 2)
    assert text.startswith("warning: ") and "\n" not in text
    for words in ("64 processes on 2 CPU core(s)", "1/32 of a core", "64 x one process's start-up"):
        assert words in text


def test_run_warns_then_launches(monkeypatch, launched, capsys):
    monkeypatch.setattr(course_dist, "cpu_count", lambda: 2)
    assert course_cli.main(["run", "--nproc=3", "--max_steps=2"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: --nproc=3 starts 3 processes on 2 CPU core(s)") and "2/3 of a core" in err
    assert [(c["nproc"], c["max_steps"]) for c in launched] == [(3, 2)]


# --- 7. one option grammar: train, run, the labs and the benchmarks ---------------------------------------

ARGV = ["--max-steps", "7", "--resume", "--out_dir", "x"]  # a space, a dash, a bare boolean


def test_labs_read_the_same_forms_as_train():
    defaults = {"max_steps": 1, "resume": False, "out_dir": "runs/x"}
    assert parse_flags(ARGV, defaults, "lab") == {"max_steps": 7, "resume": True, "out_dir": "x"}
    cfg = parse_cli(ARGV)
    assert (cfg.max_steps, cfg.resume, cfg.out_dir) == (7, True, "x")
    with pytest.raises(FlagError, match="--max_steps needs a value"):
        parse_flags(["--max_steps"], defaults, "lab")
    assert "--key value" in usage("lab", "", defaults)


def test_bench_and_run_read_the_same_forms(launched, tmp_path):
    assert bench.parse_options("overhead", ["--rounds", "2", "--check_steps", "3"])["rounds"] == 2
    assert course_cli.main(["run", "--nproc", "1", *ARGV[:3], "--out-dir", str(tmp_path)]) == 0
    assert [(c["nproc"], c["max_steps"], c["resume"], c["out_dir"]) for c in launched] == [(1, 7, True, str(tmp_path))]


def test_a_job_that_refuses_its_input_is_a_refusal_not_a_crash(tmp_path):
    from ddp_course.launch import LaunchError, LaunchRefused, run

    refuses = tmp_path / "refuses.py"
    refuses.write_text('import sys\nprint("error: --x must be positive", file=sys.stderr)\nsys.exit(2)\n')
    with pytest.raises(LaunchRefused, match="--x must be positive"):
        run(str(refuses), nproc=1, use_torchrun=False, echo="none", progress=False, timeout=60)
    crashes = tmp_path / "crashes.py"
    crashes.write_text("raise ValueError('mine')\n")
    with pytest.raises(LaunchError) as err:
        run(str(crashes), nproc=1, use_torchrun=False, echo="none", progress=False, timeout=60)
    assert not isinstance(err.value, LaunchRefused)


BAD = [["doctor", "--bogus"], ["doctor", "extra"], ["check", "09", "x.py", "y.py"], ["check", "--bogus", "x"],
       ["check", "01"], ["progress", "--bogus"], ["progress", "a", "b"], ["frobnicate"], ["update", "--bogus"],
       ["update", "--diff"], ["reset"], ["reset", "no_such_lesson"], ["reset", "--all", "01_minigpt"],
       ["run", "--corpus=/no/such/file.txt"], ["run", "--max_steps=2", "--max_steps=3"],
       ["bench", "overhead", "--corpus=/no/such/file.txt"], ["bench", "overhead", "--rounds=0"],
       ["bench", "overhead", "--rounds=2", "--rounds=3"], ["bench", "scaling", "--n_head=0"],
       ["bench", "overhead", "--device=gpu"], ["bench", "buckets", "--echo=loud"], ["bench", "gpu", "--sizes=big"],
       ["bench", "gpu", "--sizes="], ["bench", "gpu", "--warmup=0"], ["bench", "no_sync", "--timeout_s=-1"]]
if not torch.cuda.is_available():
    BAD += [["run", "--device=cuda"], ["bench", "overhead", "--device=cuda"]]
if torch.cuda.device_count() < 2:
    BAD += [["bench", "dp_vs_ddp"]]


@pytest.mark.parametrize("argv", BAD, ids=" ".join)
def test_every_command_refuses_bad_input_in_one_line_with_exit_2(argv, capsys):
    assert course_cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert not out
    one_error_line(err)


@pytest.mark.parametrize("argv", [["doctor", "--help"], ["check", "--help"], ["check", "09", "-h"],
                                  ["progress", "--help"], ["--help"]])
def test_every_commands_help_goes_to_stdout_with_exit_0(argv, capsys):
    assert course_cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert out.strip() and not err


def test_a_model_too_big_for_memory_is_refused_before_allocating(tmp_path):
    r = python_module("ddp_course.train", ["--n_embd=100000", "--max_steps=1", f"--out_dir={tmp_path}"],
                      timeout=60, check=False)
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert "240,015,700,000 parameters" in line and "GB available" in line and "smaller --n_embd" in line


def test_the_memory_check_counts_every_process_on_the_machine(monkeypatch):
    from ddp_course.dist import DistInfo
    from ddp_course.model import GPTConfig, MiniGPT

    gpt = GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=4, n_embd=64)
    assert gpt.num_params() == MiniGPT(gpt).num_params()  # the count without building the model
    weights = 4 * gpt.num_params()
    monkeypatch.setattr(train, "available_memory", lambda device: 2 * weights)
    train.check_fits(gpt, DistInfo(world_size=2, local_world_size=2))  # two copies fit exactly
    with pytest.raises(ConfigError, match="in each of the 3 process"):
        train.check_fits(gpt, DistInfo(world_size=3, local_world_size=3))
    monkeypatch.setattr(train, "available_memory", lambda device: None)  # unknown: never refuse
    train.check_fits(gpt, DistInfo(world_size=3, local_world_size=3))
