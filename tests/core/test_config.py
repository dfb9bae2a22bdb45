"""TrainConfig and its command line: every flag form, every refusal, and torchrun compatibility."""

from __future__ import annotations

import dataclasses
import re

import pytest
from torch.distributed.run import get_args_parser

from ddp_course.config import (
    ConfigError,
    TrainConfig,
    available_strategies,
    from_dict,
    help_text,
    parse_cli,
    to_cli,
)

FIELDS = [f.name for f in dataclasses.fields(TrainConfig)]


# --- accepted forms -------------------------------------------------------------------------------

def test_defaults_are_valid():
    cfg = parse_cli([])
    assert cfg == TrainConfig()


def test_key_equals_value_and_key_space_value():
    cfg = parse_cli(["--max_steps=7", "--lr", "3e-3", "--strategy=ddp", "--corpus", "offline"])
    assert cfg.max_steps == 7 and isinstance(cfg.max_steps, int)
    assert cfg.lr == pytest.approx(3e-3) and isinstance(cfg.lr, float)
    assert cfg.strategy == "ddp"
    assert cfg.corpus == "offline"


def test_negative_number_as_separate_value():
    assert parse_cli(["--fail_at_step", "-1"]).fail_at_step == -1
    assert parse_cli(["--fail_at_step=5"]).fail_at_step == 5


def test_dash_and_underscore_spellings_are_the_same_key():
    a = parse_cli(["--max-steps=11", "--micro-batch-size", "3", "--no-sync=false"])
    b = parse_cli(["--max_steps=11", "--micro_batch_size", "3", "--no_sync=false"])
    assert a == b
    assert (a.max_steps, a.micro_batch_size, a.no_sync) == (11, 3, False)


@pytest.mark.parametrize("argv, expected", [
    (["--resume"], True),  # bare flag at the end
    (["--resume", "--max_steps=3"], True),  # bare flag followed by another flag
    (["--resume=true"], True),
    (["--resume=false"], False),
    (["--resume", "false"], False),  # --key value form for a boolean
    (["--resume=yes"], True),
    (["--resume=0"], False),
])
def test_boolean_flags(argv, expected):
    assert parse_cli(argv).resume is expected


def test_bare_boolean_in_dash_form():
    cfg = parse_cli(["--activation-checkpointing", "--compile"])
    assert cfg.activation_checkpointing is True and cfg.compile is True


def test_to_cli_round_trips_every_field():
    cfg = TrainConfig(strategy="ddp", max_steps=9, lr=2.5e-3, resume=True, no_sync=False, out_dir="x/y")
    assert parse_cli(to_cli(cfg.to_dict())) == cfg


# --- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--max_step=3", "--max-step=3", "--max_step", "--max_stepz=1"])
def test_unknown_key_suggests_the_close_name(flag):
    with pytest.raises(ConfigError) as exc:
        parse_cli([flag, "3"] if "=" not in flag else [flag])
    msg = str(exc.value)
    assert "Unknown option --max_step" in msg
    assert "Did you mean --max_steps" in msg


def test_unknown_key_without_close_name_still_points_at_help():
    with pytest.raises(ConfigError, match="--help") as exc:
        parse_cli(["--qqqqqqqq=1"])
    assert "Did you mean" not in str(exc.value)


@pytest.mark.parametrize("argv, words", [
    (["--max_steps=abc"], ["--max_steps", "an integer", "'abc'"]),
    (["--lr=fast"], ["--lr", "a number", "'fast'"]),
    (["--resume=maybe"], ["--resume", "true or false", "'maybe'"]),
])
def test_wrong_type_is_refused_with_the_expected_type(argv, words):
    with pytest.raises(ConfigError) as exc:
        parse_cli(argv)
    for w in words:
        assert w in str(exc.value)


def test_from_dict_refuses_wrong_python_types_and_unknown_keys():
    with pytest.raises(ConfigError, match="--max_steps expects an integer, got float"):
        from_dict({"max_steps": 2.5})
    with pytest.raises(ConfigError, match="Did you mean --max_steps"):
        from_dict({"max_step": 3})
    assert from_dict({"max-steps": 4, "lr": 1}).lr == 1.0


def test_bad_strategy_lists_every_choice():
    with pytest.raises(ConfigError) as exc:
        parse_cli(["--strategy=fsdpp"])
    msg = str(exc.value)
    assert "'fsdpp'" in msg
    strategies = available_strategies()
    assert "single" in strategies and "ddp" in strategies
    for name in strategies:
        assert name in msg


@pytest.mark.parametrize("argv, name", [(["--device=tpu"], "device"), (["--precision=fp8"], "precision")])
def test_bad_choice_lists_choices(argv, name):
    with pytest.raises(ConfigError, match=f"--{name}=.*choose one of"):
        parse_cli(argv)


def test_n_embd_must_divide_by_n_head_and_the_hint_is_valid():
    with pytest.raises(ConfigError) as exc:
        TrainConfig(n_embd=30, n_head=4)
    msg = str(exc.value)
    assert "--n_embd=30" in msg and "--n_head=4" in msg
    suggested = int(re.search(r"try --n_embd=(\d+)", msg).group(1))
    assert suggested % 4 == 0
    TrainConfig(n_embd=suggested, n_head=4)  # the suggestion itself is accepted


def test_value_missing_and_given_twice():
    with pytest.raises(ConfigError, match="needs a value"):
        parse_cli(["--max_steps"])
    with pytest.raises(ConfigError, match="given twice"):
        parse_cli(["--max_steps=1", "--max-steps=2"])
    with pytest.raises(ConfigError, match="--key=value"):
        parse_cli(["max_steps=1"])


@pytest.mark.parametrize("argv", [["--max_steps=0"], ["--val_fraction=1.0"], ["--timeout_s=0"],
                                  ["--global_batch_size=-1"]])
def test_out_of_range_values(argv):
    with pytest.raises(ConfigError):
        parse_cli(argv)


# --- batch arithmetic ------------------------------------------------------------------------------

@pytest.mark.parametrize("micro, world, accum", [(4, 2, 4), (8, 1, 3), (2, 4, 1)])
def test_resolve_batch_sets_grad_accum_steps(micro, world, accum):
    global_batch = micro * world * accum
    cfg = TrainConfig(micro_batch_size=micro, global_batch_size=global_batch)
    cfg.resolve_batch(world)
    assert cfg.grad_accum_steps == accum
    assert cfg.global_batch(world) == global_batch


def test_resolve_batch_without_global_batch_keeps_grad_accum():
    cfg = TrainConfig(micro_batch_size=4, grad_accum_steps=3)
    cfg.resolve_batch(2)
    assert cfg.grad_accum_steps == 3
    assert cfg.global_batch(2) == 4 * 3 * 2


def test_resolve_batch_refuses_an_uneven_split_with_a_clear_message():
    micro, world, wanted = 4, 2, 30
    per_step = micro * world
    cfg = TrainConfig(micro_batch_size=micro, global_batch_size=wanted)
    with pytest.raises(ConfigError) as exc:
        cfg.resolve_batch(world)
    msg = str(exc.value)
    assert f"--global_batch_size={wanted}" in msg
    assert f"multiple of {per_step}" in msg
    # both suggested sizes are themselves valid
    lo, hi = (int(n) for n in re.search(r"for example --global_batch_size=(\d+) or (\d+)", msg).groups())
    assert lo < wanted < hi
    for n in (lo, hi):
        ok = TrainConfig(micro_batch_size=micro, global_batch_size=n)
        ok.resolve_batch(world)
        assert ok.global_batch(world) == n


# --- --help ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_exits_and_lists_every_field(flag):
    with pytest.raises(SystemExit) as exc:
        parse_cli(["--max_steps=3", flag])
    text = str(exc.value.code)
    for name in FIELDS:
        assert f"--{name}=" in text, name
    assert text == help_text()


# --- torchrun must not eat course flags -------------------------------------------------------------

def _one_flag_per_field() -> list[str]:
    """A valid value for every field (non-default where that is easy: flipped booleans, numbers + 1)."""
    special = {"strategy": "ddp", "device": "cpu", "precision": "bf16", "corpus": "offline",
               "out_dir": "runs/elsewhere", "val_fraction": 0.2, "dropout": 0.1,
               "n_head": 8, "n_embd": 256}
    flags = []
    for f in dataclasses.fields(TrainConfig):
        v = special.get(f.name, f.default)
        if isinstance(v, bool):
            v = "false" if v else "true"
        elif isinstance(v, (int, float)) and f.name not in special:
            v = v + 1
        flags.append(f"--{f.name}={v}")
    return flags


def test_torchrun_parser_passes_every_course_flag_through():
    course = _one_flag_per_field()
    assert len(course) == len(FIELDS)
    args = get_args_parser().parse_args(
        ["--standalone", "--nproc_per_node=2", "-m", "ddp_course.train", *course])
    assert args.module is True
    assert args.training_script == "ddp_course.train"
    assert args.training_script_args == course
    assert args.nproc_per_node == "2"
    parse_cli(args.training_script_args)  # and the course accepts what torchrun handed over


def test_torchrun_parser_passes_dash_spelled_flags_through():
    course = [f"--{name.replace('_', '-')}=1" for name in FIELDS if "_" in name and name != "fail_at_step"]
    args = get_args_parser().parse_args(["--standalone", "--nproc_per_node=2", "-m", "ddp_course.train", *course])
    assert args.training_script_args == course


def test_config_names_no_strategy_but_the_default_and_its_help_example():
    """A strategy's options live in its file: config.py knows the default (single) and the --strategy=ddp
    of its help's example, and no other strategy by name, in its code or its strings."""
    import ast
    from pathlib import Path

    import ddp_course.config as config

    folder = Path(config.__file__).parent / "parallel"
    strategies = {p.stem for p in folder.glob("*.py") if not p.stem.startswith("_")}
    tree = ast.parse(Path(config.__file__).read_text(encoding="utf-8"))
    words = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            words.update(w.strip("=-`'\".,:;()") for w in node.value.replace("=", " ").split())
        elif isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
    assert strategies & words <= {"single", "ddp"}, sorted(strategies & words)
    assert {"single", "fsdp", "zero1"} <= strategies  # the scan sees the strategies
