"""The strategy contract (``ddp_course/parallel/__init__.py``): a strategy module's hooks are found by
name, so a misspelt or mis-shaped one is refused when the strategy is loaded, not silently replaced by
the default; and whether a process may run a strategy is decided in one place, ``Strategy.refusal``."""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
import types

import pytest

from ddp_course import config, parallel
from ddp_course.config import ConfigError, TrainConfig, available_strategies


def _module(source: str) -> types.ModuleType:
    """A strategy module ``ddp_course.parallel.made_up`` run from ``source``, with a ``wrap`` of its own."""
    module = types.ModuleType("ddp_course.parallel.made_up")
    exec(compile("def wrap(model, info, cfg):\n    return model\n" + textwrap.dedent(source), "made_up.py", "exec"),
         vars(module))
    return module


def test_every_strategy_of_the_course_keeps_the_contract():
    for name in available_strategies():
        parallel.check_module(parallel.Strategy(name).module)


# Each probe is a strategy module that would have run with the default hook, or a hook called with
# arguments it does not take, had the check looked only at the functions defined in the file.
PROBES = {
    "an alias of the default optimizer, misspelt": (
        "from ddp_course import parallel\nbuild_optimiser = parallel.adamw\n",
        r"defines build_optimiser \(ddp_course\.parallel\._optimizer\.adamw, under the name build_optimiser\), which is "
        r"not a hook, a constant or a declared helper: did you mean build_optimizer\?.*HELPERS, or made private"),
    "an alias of another strategy's hook, misspelt": (
        "from ddp_course.parallel import ddp\nsync_contxt = ddp.sync_context\n",
        r"defines sync_contxt \(ddp_course\.parallel\.ddp\.sync_context, under the name sync_contxt\).*did you mean sync_context"),
    "an imported function, not declared": (
        "from ddp_course.parallel.fsdp import shard_layout\n",
        r"defines shard_layout \(ddp_course\.parallel\.fsdp\.shard_layout, imported\), which is not a hook.*"
        r"named in the module's HELPERS, or made private \(_shard_layout\)"),
    "PyTorch's clipping imported under the hook's name": (
        "from torch.nn.utils import clip_grad_norm_\n",
        r"the hook clip_grad_norm_ \(torch\.nn\.utils\.clip_grad\.clip_grad_norm_, imported\) takes 5 argument\(s\); "
        r"the contract .* calls it with 2"),
    "a functools.partial under a name of its own": (
        "import functools\nfrom ddp_course import parallel\nadamw_no_decay = functools.partial(parallel.adamw, ndims=None)\n",
        r"defines adamw_no_decay \(a functools\.partial of ddp_course\.parallel\._optimizer\.adamw.*not a hook"),
    "a hook of the wrong arity through a partial": (
        "import functools\nfrom ddp_course.parallel import ddp\nsync_context = functools.partial(ddp.sync_context, sync=False)\n",
        r"the hook sync_context \(a functools\.partial of ddp_course\.parallel\.ddp\.sync_context.*\) takes 1 argument"),
    "a lower-case constant": (
        "Options = ('bucket_cap_mb',)\n",
        r"defines Options \(a tuple\), which is not a hook.*did you mean OPTIONS\?"),
    "a misspelt hook defined in the file": (
        "def build_optimiser(model, cfg, device):\n    return None\n",
        r"defines build_optimiser \(a function\), which is not a hook.*did you mean build_optimizer\?"),
    "a hook defined with other arguments": (
        "def sync_context(model):\n    return None\n",
        r"the hook sync_context \(a function\) takes 1 argument\(s\); the contract .* calls it with 2"),
    "a hook that requires a keyword other than state": (
        "def sync_context(model, sync, *, plan):\n    return None\n",
        r"the hook sync_context \(a function\) takes arguments that cannot be counted \(\*args, a keyword it requires "
        r"other than state"),
    "a misspelt constant": (
        "NEEDS_PROCESS_GROUPS = False\n", r"defines NEEDS_PROCESS_GROUPS \(a bool\).*did you mean NEEDS_PROCESS_GROUP\?"),
    "a constant of the wrong type (a string, not a dict of options)": (
        "OPTIONS = ('tp')\n", r"OPTIONS must be a dict \(it is 'tp': a str\)"),
    "a lambda under a name of its own": (
        "strip_wrapper = lambda model: model.module\n", r"defines strip_wrapper \(.*<lambda>.*\), which is not a hook"),
    "an upper-case name that holds a function": (
        "from ddp_course import parallel\nOPTIMIZER = parallel.adamw\n", r"defines OPTIMIZER .*which is not a hook"),
    "a helper declared but not defined": (
        "HELPERS = ('shard_layout',)\n", r"HELPERS names shard_layout, which is not defined there"),
    "a hook declared as a helper": (
        "HELPERS = ('wrap',)\n", r"HELPERS names wrap, which is a hook or a constant, not a helper"),
}


@pytest.mark.parametrize("source, message", PROBES.values(), ids=PROBES.keys())
def test_a_name_that_is_not_a_hook_a_constant_or_a_declared_helper_is_refused(source, message):
    with pytest.raises(ConfigError, match=message):
        parallel.check_module(_module(source))


def test_a_strategy_without_wrap_is_refused():
    module = types.ModuleType("ddp_course.parallel.made_up")
    with pytest.raises(ConfigError, match=r"made_up\.py defines no wrap\(model, info, cfg\): every strategy must"):
        parallel.check_module(module)


def test_declared_helpers_aliased_hooks_constants_modules_and_classes_are_allowed():
    parallel.check_module(_module("""
        import functools
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        from ddp_course.parallel import ddp, fsdp
        from ddp_course.parallel.fsdp import shard_layout

        HELPERS = ("shard_layout", "layout", "build")
        INT8_LEVELS = 127
        sync_context = ddp.sync_context  # a hook taken from another strategy: the house idiom
        gathered = fsdp.gathered
        unwrap = functools.partial(lambda model, strict: model.module, strict=True)  # through a partial: 1 argument
        build = functools.partial(fsdp.mp_policy)

        def layout(info, cfg):
            return 1, 1

        def build_optimizer(model, cfg, device, *, state):  # the plan's per-job state, by keyword
            return state["optimizer"]

        class Wrapper(DDP):
            pass
        """))


# --- a strategy's own options (OPTIONS) ------------------------------------------------------------

def _reads(module) -> set[str]:
    """The ``cfg.<field>`` a strategy module reads: in its own source, and in the functions it takes
    from another strategy's module (``from ddp_course.parallel.fsdp import mp_policy``, ``ddp.wrap``)."""
    source = inspect.getsource(module)
    found = set(re.findall(r"\bcfg\.(\w+)", source))
    for other in available_strategies():
        theirs = parallel.Strategy(other).module
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
        module = parallel.Strategy(name).module
        declared = tuple(getattr(module, "OPTIONS", ()))
        assert config.strategy_summary(name)[1] == declared, name  # what --help reads is what the module says
        missing = (_reads(module) & set(owned)) - set(declared)
        assert not missing, f"ddp_course/parallel/{name}.py reads {sorted(missing)} but its OPTIONS leaves them out"


def test_the_scan_sees_an_option_read_through_another_strategys_function():
    assert "fsdp_mixed_precision" in _reads(parallel.Strategy("fsdp_tp").module)  # fsdp.mp_policy(cfg)
    assert {"bucket_cap_mb", "comm_hook"} <= _reads(parallel.Strategy("zero1").module)  # ddp.wrap(model, info, cfg)


def test_help_lists_every_strategy_with_its_options_in_one_column():
    text = config.help_text()
    section = text.split("strategies (--strategy=NAME)")[1].splitlines()[1:]
    for name in available_strategies():
        at = next(i for i, line in enumerate(section) if line.split()[0] == name)
        declared = getattr(parallel.Strategy(name).module, "OPTIONS", ())
        own = [line.split("=")[0].strip() for line in section[at + 1:at + 1 + len(declared)]]
        assert own == [f"--{o}" for o in declared], (name, own)
    options = text.split("\noptions:\n")[1].split("\n\n")[0].splitlines()
    assert not any(line.split("=")[0].strip()[2:] in config.strategy_options() for line in options)  # listed once
    starts = {len(m.group(1)) for line in [*options, *section] if (m := re.match(r"^(\s+\S+\s+)\S", line))}
    assert len(starts) == 1, f"the option texts start in {len(starts)} columns: {sorted(starts)}"
