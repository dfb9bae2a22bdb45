"""The strategy contract (``ddp_course/parallel/__init__.py``): a strategy module's hooks are found by
name, so a misspelt or mis-shaped one is refused when the strategy is loaded, not silently replaced by
the default; and whether a process may run a strategy is decided in one place, ``Strategy.refusal``."""

from __future__ import annotations

import types

import pytest

from ddp_course import parallel
from ddp_course.config import ConfigError, available_strategies


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
