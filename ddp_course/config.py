"""The one configuration object of the course.

Every runnable module reads a :class:`TrainConfig`. On the command line each field is a
``--key=value`` flag (``--max_steps=200`` or ``--max-steps=200``; ``--max_steps 200`` and a bare
``--resume`` too: the forms of :func:`ddp_course.cli.split_flags`, the same in every command of the
course); unknown keys and values of the wrong type are refused with a message that names the valid
choices. Flags are matched exactly, never by prefix, so they cannot be confused with torchrun's own
(abbreviating) options.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import os
import pkgutil
import tempfile
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_course.cli import GRAMMAR, HELP_FLAGS, FlagError, close_keys, convert, split_flags, type_word

PRECISIONS = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")
DATA_ORDERS = ("sampler", "stream")


class ConfigError(FlagError):
    """A bad flag or value. The message is one paragraph that says what to do instead."""


# The strategies are the modules of ddp_course/parallel, and each one's options live in its own file
# (``OPTIONS = {name: (default, help, check)}``). Both are read from that folder, from the files' syntax,
# not by importing them: ddp_course.parallel imports this module (ConfigError, TrainConfig), never the
# other way round, and listing the options needs no torch. This module names no strategy.
STRATEGY_DIR = Path(__file__).resolve().with_name("parallel")
CHECKS = ("positive", "0 or more", "at least 1")  # an option's check: one of these, a tuple of choices, or None
Option = tuple[Any, str, Any]  # (default, help, check)


def available_strategies() -> tuple[str, ...]:
    """Names of the modules in ``ddp_course/parallel`` (adding a strategy is adding one file), in the
    order of their ``HELP_ORDER`` (then by name)."""
    names = [m.name for m in pkgutil.iter_modules([str(STRATEGY_DIR)]) if not m.name.startswith("_")]
    return tuple(sorted(names, key=lambda n: (strategy_constant(n, "HELP_ORDER", 99), n)))


@functools.cache
def _constants(name: str) -> tuple[str, dict[str, ast.expr]]:
    """A strategy file's docstring and its top-level assignments, by name (its syntax tree, not run)."""
    tree = ast.parse((STRATEGY_DIR / f"{name}.py").read_text(encoding="utf-8"))
    assigned = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    return ast.get_docstring(tree) or "", assigned


def _evaluate(node: ast.expr, where: str) -> Any:
    """A constant's value from its syntax: a literal, another strategy's constant (``ddp.OPTIONS``), an
    entry of one (``fsdp.OPTIONS["x"]``), or a dict of those (``{**fsdp.OPTIONS, "x": ...}``)."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return strategy_constant(node.value.id, node.attr)
    if isinstance(node, ast.Subscript):
        return _evaluate(node.value, where)[ast.literal_eval(node.slice)]
    if isinstance(node, ast.Dict):
        out: dict[Any, Any] = {}
        for key, value in zip(node.keys, node.values):
            out.update(_evaluate(value, where) if key is None else {ast.literal_eval(key): _evaluate(value, where)})
        return out
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ConfigError(f"{where} is not a literal nor another strategy's constant: the course reads it without "
                          "running the file (nor torch), so write it out.") from None


def strategy_constant(name: str, constant: str, default: Any = None) -> Any:
    """The value of ``constant`` in ``ddp_course/parallel/<name>.py``, read without importing it."""
    node = _constants(name)[1].get(constant)
    return default if node is None else _evaluate(node, f"ddp_course/parallel/{name}.py: {constant}")


def strategy_summary(name: str) -> tuple[str, tuple[str, ...]]:
    """A strategy's first docstring line and the names of its options (its file's ``OPTIONS``)."""
    doc = _constants(name)[0].strip().splitlines()
    return (doc[0] if doc else ""), tuple(own_options(name))


def own_options(name: str) -> dict[str, Option]:
    """``{option: (default, help, check)}`` of one strategy, checked for shape."""
    options = strategy_constant(name, "OPTIONS", {})
    for option, spec in options.items():
        ok = (isinstance(option, str) and isinstance(spec, tuple) and len(spec) == 3 and isinstance(spec[1], str)
              and type(spec[0]) in (bool, int, float, str) and (spec[2] is None or spec[2] in CHECKS
                                                                or isinstance(spec[2], tuple)))
        if not ok:
            raise ConfigError(f"ddp_course/parallel/{name}.py: OPTIONS[{option!r}] = {spec!r} is not (default, help, "
                              f"check): a default of type bool, int, float or str, its help, and a check that is "
                              f"None, a tuple of choices or one of {', '.join(CHECKS)}.")
    return options


def strategy_options() -> dict[str, tuple[str, ...]]:
    """``{option: strategies that read it}`` for every option a strategy declares."""
    owners: dict[str, tuple[str, ...]] = {}
    for name in available_strategies():
        for option in own_options(name):
            owners[option] = (*owners.get(option, ()), name)
    return owners


def option_specs() -> dict[str, Option]:
    """Every strategy's options, once each; two strategies that declare one option alike share it."""
    specs: dict[str, Option] = {}
    for name in available_strategies():
        for option, spec in own_options(name).items():
            if specs.setdefault(option, spec) != spec:
                raise ConfigError(f"--{option} is declared twice, differently (ddp_course/parallel/{name}.py and "
                                  "another strategy): share the other's entry (other.OPTIONS[name]).")
    return specs


def _check_option(name: str, value: Any, spec: Option) -> None:
    _, help_, check = spec
    if isinstance(check, tuple) and value not in check:
        raise ConfigError(f"--{name}={value!r} is not one of {', '.join(map(str, check))} ({help_}).")
    bounds = {"positive": lambda v: v > 0, "0 or more": lambda v: v >= 0, "at least 1": lambda v: v >= 1}
    if isinstance(check, str) and not bounds[check](value):
        raise ConfigError(f"--{name} must be {check} (got {value}): {help_}.")


@dataclass(kw_only=True)
class CoreConfig:
    """The options of the training run that are no strategy's own (TrainConfig adds those)."""

    # --- what runs where -------------------------------------------------------------------
    strategy: str = "single"  # how the model is replicated: one of the strategies listed below
    device: str = "auto"  # auto: CUDA+NCCL when every local rank has its own GPU, else CPU+gloo
    precision: str = "fp32"  # fp32 | bf16 | fp16 (fp16 adds a GradScaler)
    threads: int = 0  # CPU threads per process; 0 = cores divided by the processes on this node
    timeout_s: float = 120.0  # process-group timeout: a stuck collective fails after this long
    # --- data --------------------------------------------------------------------------------
    corpus: str = "tinyshakespeare"  # tinyshakespeare | offline | a path to a UTF-8 text file
    val_fraction: float = 0.1  # the tail of the corpus held out for evaluation
    num_workers: int = 0  # DataLoader worker processes per rank
    data_order: str = "sampler"  # sampler: DistributedSampler epochs | stream: random windows, rank-offset slices
    # --- model -------------------------------------------------------------------------------
    block_size: int = 64  # context length in tokens
    n_layer: int = 2  # transformer blocks
    n_head: int = 4  # attention heads per block
    n_embd: int = 128  # width of the residual stream
    dropout: float = 0.0  # dropout probability (0 keeps runs comparable across strategies)
    activation_checkpointing: bool = False  # recompute each block in backward to save memory
    # --- optimisation ------------------------------------------------------------------------
    max_steps: int = 200  # optimizer steps
    micro_batch_size: int = 16  # sequences per rank per forward/backward
    grad_accum_steps: int = 1  # micro-batches accumulated per optimizer step (per rank)
    global_batch_size: int = 0  # if > 0: sequences per optimizer step; sets grad_accum_steps
    no_sync: bool = True  # skip the gradient all-reduce on non-final micro-steps (DDP)
    lr: float = 1e-3  # peak learning rate
    min_lr: float = 1e-4  # learning rate at the end of the cosine decay
    warmup_steps: int = 20  # linear warm-up from 0 to lr
    weight_decay: float = 0.1  # AdamW decay, applied to matrices only
    grad_clip: float = 1.0  # clip the global gradient norm to this (0 = off)
    seed: int = 1337  # model init is seeded identically on every rank; data order per epoch
    # --- evaluation, logging, checkpoints ----------------------------------------------------
    eval_interval: int = 50  # evaluate every N steps (and at the end); 0 = only at the end
    eval_batches: int = 8  # validation micro-batches per rank per evaluation
    log_interval: int = 10  # write a metrics row every N steps
    out_dir: str = "runs/default"  # where config.json, metrics.jsonl, summary.json are written
    ckpt_interval: int = 0  # save a checkpoint every N steps (0 = never)
    resume: bool = False  # continue from the latest checkpoint in out_dir
    keep_last: int = 2  # checkpoints kept on disk (older ones are deleted after a save)
    ckpt_format: str = "full"  # full: one file written by rank 0 | sharded: torch.distributed.checkpoint, every rank writes its part
    compile: bool = False  # torch.compile the model before wrapping
    sample_tokens: int = 0  # if > 0: generate this many characters at the end (rank 0)
    fail_at_step: int = -1  # fault injection: rank `fail_rank` raises after this step, on torchrun's first attempt only (-1 = off)
    fail_rank: int = 0  # which rank fails when fail_at_step is set

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------------------------------
    def validate(self) -> None:
        def bad(msg: str) -> ConfigError:
            return ConfigError(msg)

        strategies = available_strategies()
        if self.strategy not in strategies:
            raise bad(f"--strategy={self.strategy!r} is not a strategy; choose one of {', '.join(strategies)}.")
        if self.device not in DEVICES:
            raise bad(f"--device={self.device!r} is not a device choice; choose one of {', '.join(DEVICES)}.")
        if self.precision not in PRECISIONS:
            raise bad(f"--precision={self.precision!r} is not supported; choose one of {', '.join(PRECISIONS)}.")
        for name in ("block_size", "n_layer", "n_head", "n_embd", "max_steps", "micro_batch_size",
                     "grad_accum_steps", "eval_batches", "log_interval"):
            if getattr(self, name) < 1:
                raise bad(f"--{name} must be at least 1 (got {getattr(self, name)}).")
        if self.n_embd % self.n_head:
            raise bad(f"--n_embd={self.n_embd} must be divisible by --n_head={self.n_head} "
                      f"(each head gets n_embd / n_head channels); try --n_embd={self.n_head * max(1, self.n_embd // self.n_head)}.")
        if not 0.0 < self.val_fraction < 1.0:
            raise bad(f"--val_fraction must be between 0 and 1 (got {self.val_fraction}).")
        if self.timeout_s <= 0:
            raise bad(f"--timeout_s must be positive (got {self.timeout_s}).")
        if self.data_order not in DATA_ORDERS:
            raise bad(f"--data_order={self.data_order!r} is not a data order; choose one of {', '.join(DATA_ORDERS)}.")
        if self.ckpt_format not in ("full", "sharded"):
            raise bad(f"--ckpt_format={self.ckpt_format!r} is not a checkpoint format; choose full or sharded.")
        if self.global_batch_size < 0:
            raise bad(f"--global_batch_size must be 0 (unused) or positive (got {self.global_batch_size}).")
        for name, spec in option_specs().items():  # each strategy's options, by the checks its file gives
            if hasattr(self, name):
                _check_option(name, getattr(self, name), spec)

    def resolve_batch(self, world_size: int) -> None:
        """Fix ``grad_accum_steps`` from ``global_batch_size`` for this world size.

        global batch = micro_batch_size x grad_accum_steps x world_size. Raises ConfigError when the
        requested global batch cannot be split evenly.
        """
        if self.global_batch_size <= 0:
            return
        per_step = self.micro_batch_size * world_size
        if self.global_batch_size % per_step:
            lo = (self.global_batch_size // per_step) * per_step
            hint = f"--global_batch_size={lo} or {lo + per_step}" if lo else f"--global_batch_size={per_step}"
            raise ConfigError(
                f"--global_batch_size={self.global_batch_size} does not divide into micro-batches of "
                f"{self.micro_batch_size} on {world_size} rank(s): grad_accum_steps = global_batch_size / "
                f"(micro_batch_size x world_size) = {self.global_batch_size} / {per_step} = "
                f"{self.global_batch_size / per_step:g}, not a whole number. "
                f"Use a multiple of {per_step} (for example {hint}), or change --micro_batch_size.")
        steps = self.global_batch_size // per_step
        if self.grad_accum_steps not in (1, steps):
            raise ConfigError(
                f"--global_batch_size={self.global_batch_size} sets grad_accum_steps = {self.global_batch_size} / "
                f"{per_step} = {steps} on {world_size} rank(s), but --grad_accum_steps={self.grad_accum_steps} was "
                "also given. Give one of the two.")
        self.grad_accum_steps = steps

    def global_batch(self, world_size: int) -> int:
        return self.micro_batch_size * self.grad_accum_steps * world_size

    # ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> TrainConfig:
        return from_dict({**self.to_dict(), **changes})


# The config of a run: CoreConfig's fields, then every strategy's options (its file's OPTIONS).
TrainConfig = dataclasses.make_dataclass(
    "TrainConfig", [(name, type(default), dataclasses.field(default=default))
                    for name, (default, _, _) in option_specs().items()],
    bases=(CoreConfig,), kw_only=True,
    namespace={"__module__": __name__, "__doc__": "CoreConfig's fields and every strategy's own options."})


@functools.cache  # the fields are fixed at import; evaluating the annotations costs ms, once per option checked
def _field_types() -> dict[str, type]:
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig)}


def _unknown_key(key: str) -> ConfigError:
    close = close_keys(key, _field_types(), n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    return ConfigError(f"Unknown option --{key}.{hint} Run `python -m ddp_course.train --help` for every option.")


def _from_text(key: str, typ: type, value: str) -> Any:
    """A command-line string as the field's type (the same conversion as every ``--key=value`` parser)."""
    try:
        return convert(value.strip(), typ)
    except ValueError:
        raise ConfigError(f"--{key} expects {type_word(typ)} (got {value!r}).") from None


def _from_python(key: str, typ: type, value: Any) -> Any:
    """A Python value (from :func:`from_dict`) checked against the field's type; ints widen to floats."""
    if typ is bool and isinstance(value, bool):
        return value
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if typ is str and isinstance(value, str):
        return value
    if typ is str and hasattr(value, "__fspath__"):
        return str(value)
    raise ConfigError(f"--{key} expects {type_word(typ)}, got {type(value).__name__} {value!r}.")


def coerce(key: str, value: Any) -> Any:
    """Convert ``value`` (a string from the command line, or a Python value) to the field's type."""
    types = _field_types()
    if key not in types:
        raise _unknown_key(key)
    if isinstance(value, str):
        return _from_text(key, types[key], value)
    return _from_python(key, types[key], value)


def from_dict(values: dict[str, Any]) -> TrainConfig:
    """Build a validated config from keyword values (unknown keys and wrong types refused)."""
    return TrainConfig(**{k.replace("-", "_"): coerce(k.replace("-", "_"), v) for k, v in values.items()})


TRAIN_EXAMPLE = "torchrun --standalone --nproc_per_node=2 -m ddp_course.train --strategy=ddp"


def help_text(prog: str = "python -m ddp_course.train", example: str = TRAIN_EXAMPLE,
              extra: dict[str, tuple[Any, str]] | None = None) -> str:
    """``--help``: every field, its default and the comment written beside it (after ``extra``, the
    options of a command around the training run: ``{name: (default, help)}``)."""
    src = inspect.getsource(CoreConfig).splitlines()
    comments = {}
    for line in src:
        stripped = line.strip()
        if ":" in stripped and "#" in stripped and not stripped.startswith("#"):
            name = stripped.split(":", 1)[0].strip()
            comments[name] = stripped.split("#", 1)[1].strip()
    flags = {f"--{name}={default!s}": text for name, (default, text) in (extra or {}).items()}
    summaries = {name: strategy_summary(name) for name in available_strategies()}
    owned = {option for _, options in summaries.values() for option in options}
    comments.update({name: text for name, (_, text, _) in option_specs().items()})
    fields = {f.name: (f"--{f.name}={f.default!s}", comments.get(f.name, "")) for f in dataclasses.fields(TrainConfig)}
    flags.update({flag: text for name, (flag, text) in fields.items() if name not in owned})
    width = max(*map(len, flags), *(len(fields[o][0]) + 4 for o in owned)) + 2  # one column for every text
    lines = [f"usage: {prog} [--key=value ...]", "", f"  {example}", "", GRAMMAR, "", "options:"]
    lines += [f"  {flag:<{width}}{text}" for flag, text in flags.items()]
    lines += ["", "strategies (--strategy=NAME), each with the options it reads:"]
    for name, (doc, options) in summaries.items():
        lines.append(f"  {name:<{width}}{doc.replace('``', '')}")
        lines += [f"      {fields[o][0]:<{width - 4}}{fields[o][1]}" for o in options]
    return "\n".join(lines)


def parse_cli(argv: list[str]) -> TrainConfig:
    """Parse the options (``--key=value``, ``--key value``, a bare ``--flag`` for a boolean: the forms of
    :func:`ddp_course.cli.split_flags`). ``--help`` raises SystemExit with :func:`help_text`."""
    if any(a in HELP_FLAGS for a in argv):
        raise SystemExit(help_text())
    values: dict[str, Any] = {}
    types = _field_types()
    for key, value, args in split_flags(argv, lambda k: types.get(k) is bool):
        if not key:
            raise ConfigError(f"Unexpected argument {args[0]!r}. {GRAMMAR} For example --max_steps=100.")
        if key not in types:
            raise _unknown_key(key)
        if value is None:
            raise ConfigError(f"--{key} needs a value, e.g. --{key}={getattr(TrainConfig(), key)}.")
        if key in values:
            raise ConfigError(f"--{key} is given twice.")
        values[key] = coerce(key, value)
    return TrainConfig(**values)


def check_out_dir(out_dir: str) -> None:
    """Create ``out_dir`` (and its parents) and write a file in it, before a run starts: a folder that
    cannot be had raises :class:`ConfigError` saying why, rather than a traceback after the set-up."""
    path = Path(out_dir)
    advice = "pass a folder you can write to, e.g. --out_dir=runs/my_run."
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out_dir={out_dir} cannot be created: {_why(path, exc)}; {advice}") from None
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(f"--out_dir={out_dir} cannot be written to: {_why(path, exc)}; {advice}") from None


def _why(path: Path, exc: OSError) -> str:
    """Why ``path`` cannot be a folder: a file in its way, else the system's reason."""
    for p in (*reversed(path.parents), path):
        if os.path.exists(p) and not os.path.isdir(p):
            return f"{p} is a file, not a folder"
    return f'the system answered "{exc.strerror or exc}"'


def to_cli(values: dict[str, Any]) -> list[str]:
    """The ``--key=value`` flags for a dict of overrides (the inverse of :func:`parse_cli`)."""
    out = []
    for k, v in values.items():
        if isinstance(v, bool):
            v = "true" if v else "false"
        out.append(f"--{k}={v}")
    return out


__all__ = ["TrainConfig", "ConfigError", "parse_cli", "from_dict", "to_cli", "help_text", "check_out_dir",
           "available_strategies", "PRECISIONS", "DEVICES"]
