"""The strategy contract (``ddp_course/parallel/__init__.py``): a strategy module's hooks are found by
name, so a misspelt or mis-shaped one is refused when the strategy is loaded, not silently replaced by
the default; and whether a process may run a strategy is decided in one place, ``Strategy.refusal``."""

from __future__ import annotations

import dataclasses
import inspect
import re
import types

import pytest

from ddp_course import config, parallel
from ddp_course.config import ConfigError, TrainConfig, available_strategies


def _module(**names) -> types.ModuleType:
    """A strategy module ``ddp_course.parallel.made_up`` defining ``names`` (functions become its own)."""
    module = types.ModuleType("ddp_course.parallel.made_up")
    for name, value in names.items():
        if callable(value):
            value.__module__ = module.__name__
        setattr(module, name, value)
    return module


def _wrap(model, info, cfg):
    return model


def test_every_strategy_of_the_course_keeps_the_contract():
    for name in available_strategies():
        parallel.check_module(parallel.get(name).module)


def test_a_misspelt_hook_is_refused_with_the_hook_it_meant():
    def build_optimiser(model, cfg, device):
        return None

    with pytest.raises(ConfigError, match=r"defines build_optimiser, which is not a hook: did you mean build_optimizer"):
        parallel.check_module(_module(wrap=_wrap, build_optimiser=build_optimiser))


def test_a_misspelt_constant_and_a_hook_with_other_arguments_are_refused():
    with pytest.raises(ConfigError, match="did you mean NEEDS_PROCESS_GROUP"):
        parallel.check_module(_module(wrap=_wrap, NEEDS_PROCESS_GROUPS=False))

    def sync_context(model):
        return None

    with pytest.raises(ConfigError, match="the hook sync_context takes 1 argument"):
        parallel.check_module(_module(wrap=_wrap, sync_context=sync_context))
    with pytest.raises(ConfigError, match="defines no wrap"):
        parallel.check_module(_module())


def test_a_strategy_helper_with_a_name_of_its_own_is_allowed():
    def shard_layout(info, cfg):
        return 1, 1

    parallel.check_module(_module(wrap=_wrap, shard_layout=shard_layout))


# --- a strategy's own options (OPTIONS) ------------------------------------------------------------

def _reads(module) -> set[str]:
    """The ``cfg.<field>`` a strategy module reads: in its own source, and in the functions it takes
    from another strategy's module (``from ddp_course.parallel.fsdp import mp_policy``, ``ddp.wrap``)."""
    source = inspect.getsource(module)
    found = set(re.findall(r"\bcfg\.(\w+)", source))
    for other in available_strategies():
        theirs = parallel.get(other).module
        if theirs is module:
            continue
        used = set(re.findall(rf"\b{other}\.(\w+)\(", source))
        used |= {n for n, v in vars(module).items() if inspect.isfunction(v) and v.__module__ == theirs.__name__}
        for name in used & set(vars(theirs)):
            if inspect.isfunction(vars(theirs)[name]):
                found |= _reads_function(theirs, name)
    return found


def _reads_function(module, name: str, seen: set[str] | None = None) -> set[str]:
    """The ``cfg.<field>`` read by ``module.name`` and by the module's functions it calls, transitively."""
    seen = set() if seen is None else seen
    seen.add(name)
    source = inspect.getsource(vars(module)[name])
    found = set(re.findall(r"\bcfg\.(\w+)", source))
    for called in set(re.findall(r"\b(\w+)\(", source)) - seen:
        if inspect.isfunction(vars(module).get(called)) and vars(module)[called].__module__ == module.__name__:
            found |= _reads_function(module, called, seen)
    return found


def test_every_strategy_declares_the_options_it_reads_and_only_real_ones():
    owned = config.strategy_options()
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert owned and set(owned) <= fields, set(owned) - fields
    for name in available_strategies():
        module = parallel.get(name).module
        declared = tuple(getattr(module, "OPTIONS", ()))
        assert config.strategy_summary(name)[1] == declared, name  # what --help reads is what the module says
        missing = (_reads(module) & set(owned)) - set(declared)
        assert not missing, f"ddp_course/parallel/{name}.py reads {sorted(missing)} but its OPTIONS leaves them out"


def test_the_scan_sees_an_option_read_through_another_strategys_function():
    assert "fsdp_mixed_precision" in _reads(parallel.get("fsdp_tp").module)  # fsdp.mp_policy(cfg)
    assert {"bucket_cap_mb", "comm_hook"} <= _reads(parallel.get("zero1").module)  # ddp.wrap(model, info, cfg)


def test_help_lists_every_strategy_with_its_options_in_one_column():
    text = config.help_text()
    section = text.split("strategies (--strategy=NAME)")[1].splitlines()[1:]
    for name in available_strategies():
        at = next(i for i, line in enumerate(section) if line.split()[0] == name)
        declared = getattr(parallel.get(name).module, "OPTIONS", ())
        own = [line.split("=")[0].strip() for line in section[at + 1:at + 1 + len(declared)]]
        assert own == [f"--{o}" for o in declared], (name, own)
    options = text.split("\noptions:\n")[1].split("\n\n")[0].splitlines()
    assert not any(line.split("=")[0].strip()[2:] in config.strategy_options() for line in options)  # listed once
    starts = {len(m.group(1)) for line in [*options, *section] if (m := re.match(r"^(\s+\S+\s+)\S", line))}
    assert len(starts) == 1, f"the option texts start in {len(starts)} columns: {sorted(starts)}"
