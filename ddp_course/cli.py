"""The one ``--key=value`` parser and the one command wrapper of every runnable module.

    opts = parse_flags(argv, {"out_dir": "runs/x", "timeout_s": 15.0}, prog="python -m ddp_course.course.l02_collectives.mismatch")

    @command
    def main(argv: list[str]) -> int: ...        # a FlagError raised inside -> "error: ..." and exit code 2

Each value is converted to the type of its default; an unknown key, a missing value or a value of
the wrong type raises :class:`FlagError` with one paragraph that says what to write instead. Keys
are matched exactly (never by prefix), and ``-`` in a key is read as ``_``.

Every command of the course reads its options with :func:`split_flags`, so they all take the same
forms (:data:`GRAMMAR`): ``--key=value``, ``--key value``, and a bare ``--flag`` for a boolean (true).
"""

from __future__ import annotations

import difflib
import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
GRAMMAR = ("Options are written --key=value (or --key value; a bare --flag sets a boolean to true); "
           "- and _ in a key are the same.")
HELP_FLAGS = ("-h", "--help")


class FlagError(ValueError):
    """A bad command-line option. The message says what the valid options are."""


def usage(prog: str, doc: str | None, defaults: dict[str, Any], helps: dict[str, str] | None = None) -> str:
    """The ``--help`` text: how to run ``prog``, its docstring, then each option with its default."""
    helps = helps or {}
    if not defaults:
        return "\n".join([f"usage: {prog}", "", (doc or "").strip()])
    lines = [f"usage: {prog} [--key=value ...]", "", (doc or "").strip(), "", GRAMMAR, "", "options:"]
    lines += [f"  {'--' + k + '=' + str(v):<28} {helps.get(k, '')}".rstrip() for k, v in defaults.items()]
    return "\n".join(lines)


def split_flags(argv: list[str], is_bool: Callable[[str], bool]) -> Iterator[tuple[str, str | None, list[str]]]:
    """Each option of ``argv`` as ``(key, value, args)``, the one reading of the course's option forms.

    ``--key=value``, ``--key value``, or a bare ``--flag`` when ``is_bool(key)`` (value ``"true"``; a
    boolean still takes a following value that is not an option: ``--resume false``). ``-`` in a key
    is read as ``_``. ``key`` is ``""`` for an argument that is not an option; ``value`` is None for an
    option with nothing after it; ``args`` are the arguments it was read from, as written."""
    i = 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if not arg.startswith("--") or arg == "--":
            yield "", None, [arg]
            continue
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if eq:
            yield key, value, [arg]
        elif is_bool(key) and (i == len(argv) or argv[i].startswith("--")):
            yield key, "true", [arg]
        elif i < len(argv):
            yield key, argv[i], [arg, argv[i]]
            i += 1
        else:
            yield key, None, [arg]


def parse_flags(argv: list[str], defaults: dict[str, Any], prog: str, *, doc: str | None = None,
                helps: dict[str, str] | None = None) -> dict[str, Any]:
    """Return ``defaults`` updated from the options in ``argv``, each converted to its default's type
    (the forms of :func:`split_flags`; an option given twice is refused, as ``config.parse_cli`` refuses it).

    ``-h`` or ``--help`` prints :func:`usage` (``doc`` and the per-option ``helps``) and exits 0."""
    if any(a in HELP_FLAGS for a in argv):
        print(usage(prog, doc, defaults, helps), flush=True)
        raise SystemExit(0)
    values, given = dict(defaults), set()
    valid = ("The options and their defaults are: " + ", ".join(f"--{k}={v}" for k, v in defaults.items()) + "."
             if defaults else "It takes no options.")
    for key, value, args in split_flags(argv, lambda k: type(defaults.get(k)) is bool):
        if not key:
            raise FlagError(f"{prog}: unexpected argument {args[0]!r}. {GRAMMAR} {valid}")
        if key not in defaults:
            close = close_keys(key, defaults)
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
            raise FlagError(f"{prog}: unknown option --{key}.{hint} {valid}")
        default = defaults[key]
        if value is None:
            raise FlagError(f"{prog}: --{key} needs a value, e.g. --{key}={default}.")
        if key in given:
            raise FlagError(f"{prog}: --{key} is given twice; give it once.")
        given.add(key)
        try:
            values[key] = convert(value, type(default))
        except ValueError:
            raise FlagError(f"{prog}: --{key} expects {type_word(type(default))} (got {value!r}), "
                            f"e.g. --{key}={default}.") from None
    return values


def type_word(typ: type) -> str:
    """How a message names what a flag of type ``typ`` expects: "an integer", "a number", ..."""
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(typ, typ.__name__)


def convert(value: str, typ: type) -> Any:
    """``value`` from the command line as a ``typ``: ``1/true/yes/on`` and ``0/false/no/off`` (any case)
    for ``bool``, else ``typ(value)``. Raises ValueError when it does not convert; the caller words the message."""
    if typ is bool:
        if value.lower() not in _TRUE + _FALSE:
            raise ValueError(value)
        return value.lower() in _TRUE
    return typ(value)


def number_list(text: Any, key: str, typ: type = float, example: str = "25,0.1,0.05") -> list:
    """An option like ``--key=25,0.1,0.05`` as a list of ``typ`` (``int`` or ``float``); a float list
    must be positive. Raises :class:`FlagError` that shows the form to write."""
    what = "integers" if typ is int else "positive numbers"
    try:
        values = [typ(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or (typ is not int and min(values) <= 0):
        raise FlagError(f"--{key}={text!r} must be comma-separated {what}, e.g. --{key}={example}.")
    return values


def close_keys(key: str, keys: Iterable[str], n: int = 2) -> list[str]:
    """Up to ``n`` of ``keys`` spelled like ``key``, as ``--name`` flags, for a "Did you mean" hint."""
    return ["--" + k for k in difflib.get_close_matches(key, list(keys), n=n)]


def command(main: Callable[[list[str]], int | None]) -> Callable[[list[str] | None], int]:
    """Wrap a module's ``main(argv) -> int``: ``argv`` defaults to ``sys.argv[1:]``, and a
    :class:`FlagError` (bad input; :class:`ddp_course.config.ConfigError` is one) becomes one
    ``error: ...`` paragraph on stderr and exit code 2, the course's answer to bad input everywhere."""
    @functools.wraps(main)
    def wrapped(argv: list[str] | None = None) -> int:
        try:
            return int(main(sys.argv[1:] if argv is None else list(argv)) or 0)
        except FlagError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
    return wrapped
