"""Parallelism techniques, one module each: a strategy is one file, and the whole plan of a run.

A module ``ddp_course/parallel/<name>.py`` is the strategy ``--strategy=<name>`` (``TrainConfig``
lists this folder). It must define ``wrap(model, info, cfg) -> nn.Module``; the model arrives on its
device, built identically on every rank (same seed). It may define any of the other decisions a
strategy makes; what it leaves out takes the default written here, in :class:`Strategy`:

=======================  ==========================================  =========================================
name in the module       what it decides                             default
=======================  ==========================================  =========================================
``NEEDS_PROCESS_GROUP``  whether it needs torchrun and a process     ``True`` (``single`` and ``dp`` say
                         group (checked before anything is built)    ``False``: one process)
``OPTIONS``              its own options, ``{name: (default, help,   ``{}``
                         check)}``: ``TrainConfig`` fields, checked,
                         listed under it by ``--help`` (read from the
                         file by ``config``, without importing it;
                         another's: ``OPTIONS = ddp.OPTIONS``)
``TWO_RANKS``            the values of its options it needs to run   ``{}``
                         on 2 ranks (the every-strategy test)
``HELP_ORDER``           its place in ``--help``'s list               99, then by name
``HELPERS``              its public names that are not hooks          ``()``
``build_optimizer``      ``(model, cfg, device) -> Optimizer``       :func:`adamw`: decay on matrices only
``sync_context``         ``(model, sync) -> context``: a micro-step  a no-op context (nothing is synchronised
                         that must not synchronise gradients          in backward)
``clip_grad_norm_``      ``(model, max_norm) -> Tensor``: the global  ``torch.nn.utils.clip_grad_norm_``
                         norm over every rank's gradients, clipped
``unwrap``               ``(model) -> nn.Module``: the plain model    the model itself (``torch.compile``'s
                         inside the wrapper                           wrapper removed)
``gathered``             ``(model) -> nn.Module``: full parameters    :meth:`Strategy.unwrap`
                         on rank 0, for sampling (a collective)
``state_dict``           ``(model, optimizer, options) -> (model's,   ``torch.distributed.checkpoint``'s
                         optimizer's)``: states keyed by parameter    ``get_state_dict`` (``checkpoint.DCP``);
                         name, for checkpoints and fingerprints       ``options``: its ``StateDictOptions``
``load_state_dict``      ``(model, optimizer, model_sd, optim_sd,     ``set_state_dict``
                         options) -> None``: put them back
``has_state``            ``(optimizer) -> bool``: whether it holds    ``bool(optimizer.state)``
                         state yet (before its first step it has
                         none, and reading it would create it)
``devices_per_rank``     ``(model) -> int``: devices one rank         1
                         computes on (for MFU)
``data_parallel``        ``(rank, world_size, cfg) -> (dp rank,       ``(rank, world_size)``: every rank its
                         dp size)``: which batches a rank reads;     own batches
                         ranks of one dp rank read the same ones
``model_state_dict``     ``(model, options) -> dict``: the model's    ``get_model_state_dict``
                         state alone (final.pt, fingerprints)
``forward_backward``     ``(model, micro_batches, autocast) ->        the training loop's own: each
                         Tensor``: a step's forwards and backwards    micro-batch's forward, then its
                         in the strategy's order (a pipeline's        backward (its loss divided by K),
                         schedule); the mean loss, on every rank      under ``sync_context``
=======================  ==========================================  =========================================

What a strategy learns while it wraps and its other hooks need later (FSDP x TP's tensor-parallel size,
FSDP1's parameter dimensions before it flattens them) is kept by the plan, never on the model: any hook,
``wrap`` included, may take a keyword-only ``state`` besides the table's arguments, and every hook of
one plan is handed the same dict (:attr:`Strategy.state`, empty until ``wrap`` fills it).

Every other public name of the module must be a constant (an upper-case name holding data), a class,
a module it imports, or a helper it names in ``HELPERS`` (a tuple of names: its own public functions
other code uses, and the functions it imports under their own names, such as ``fully_shard``);
anything else -- a function, an alias (``build_optimiser = parallel.adamw``), an imported function, a
``functools.partial``, a lower-case constant -- is refused when the strategy is loaded (:func:`check_module`),
with the hook or constant it is close to; a hook whose arguments (counted through a partial) differ
from the table's is refused too. :class:`StrategyModule` spells the contract for a type checker.
Whether a process can run the strategy at all (started by torchrun or not, how many ranks) is
decided in one place, :meth:`Strategy.refusal`, from ``NEEDS_PROCESS_GROUP``; a module may give
``LAUNCH_EXAMPLE``, the torchrun arguments the refusal suggests.

A plan is one job's: the training job builds it once (:func:`plan_for`, a fresh :class:`Strategy`)
and holds it: it wraps (once), builds the optimizer, steps and samples through it, and hands it to
``checkpoint``, whose functions that read or write states require it (inside the job's
``checkpoint.TrainState`` for ``save`` and ``resume``, ``plan=`` elsewhere; checkpoint never looks a plan up). Code that only holds a wrapped model (a lesson calling ``train_step``) finds the plan that
wrapped it with :func:`strategy_of` (:meth:`Strategy.wrap` records it; a wrapper built by hand is
recorded with :func:`record`): nothing asks the model which wrapper it is. A model nobody wrapped here
gets the defaults, right for a plain model.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import inspect
import sys
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn as nn

if TYPE_CHECKING:  # imported where used: torch.distributed.checkpoint is slow to import
    from torch.distributed.checkpoint.state_dict import StateDictOptions

from ddp_course.checkpoint import DCP
from ddp_course.config import ConfigError, TrainConfig
from ddp_course.dist import DistInfo
from ddp_course.parallel._optimizer import adamw, adamw_options, decay_groups  # noqa: F401 -- the default, and lessons' import

_WRAPPED: weakref.WeakKeyDictionary[nn.Module, Strategy] = weakref.WeakKeyDictionary()  # wrapper -> its plan


def without_compile(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped, or the model itself.

    Called on every micro-step (through :func:`strategy_of`): it never imports ``torch._dynamo``
    (over a second), which a compiled model has loaded already.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return model._orig_mod if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule) else model


class StrategyModule(Protocol):
    """What a strategy module may define (the table above); only ``wrap`` is required."""

    NEEDS_PROCESS_GROUP: bool
    LAUNCH_EXAMPLE: str
    OPTIONS: dict[str, tuple[Any, str, Any]]
    HELPERS: tuple[str, ...]
    TWO_RANKS: dict[str, Any]
    HELP_ORDER: int

    def wrap(self, model: nn.Module, info: DistInfo, cfg: TrainConfig) -> nn.Module: ...
    def build_optimizer(self, model: nn.Module, cfg: Any, device: torch.device) -> torch.optim.Optimizer: ...
    def sync_context(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager: ...
    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor: ...
    def unwrap(self, model: nn.Module) -> nn.Module: ...
    def gathered(self, model: nn.Module) -> nn.Module: ...
    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                   options: StateDictOptions | None) -> tuple[dict, dict]: ...
    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict,
                        options: StateDictOptions | None) -> None: ...
    def has_state(self, optimizer: torch.optim.Optimizer) -> bool: ...
    def devices_per_rank(self, model: nn.Module) -> int: ...
    def data_parallel(self, rank: int, world_size: int, cfg: Any) -> tuple[int, int]: ...
    def model_state_dict(self, model: nn.Module, options: StateDictOptions | None) -> dict: ...
    def forward_backward(self, model: nn.Module, micro_batches: list,
                         autocast: Callable[[], contextlib.AbstractContextManager]) -> torch.Tensor: ...


# every hook, with the number of arguments it takes (StrategyModule's methods, less ``self``)
HOOKS: dict[str, int] = {name: len(inspect.signature(fn).parameters) - 1
                         for name, fn in vars(StrategyModule).items() if inspect.isfunction(fn) and name[0] != "_"}
# the constants the contract reads, with the type each must hold
CONSTANTS: dict[str, type] = {"NEEDS_PROCESS_GROUP": bool, "LAUNCH_EXAMPLE": str, "OPTIONS": dict, "HELPERS": tuple,
                              "TWO_RANKS": dict, "HELP_ORDER": int}
STATE = "state"  # the keyword-only argument through which a hook reaches its plan's per-job state
CONTRACT = "ddp_course/parallel/__init__.py"


def positional_arity(fn: Callable[..., Any]) -> int | None:
    """How many arguments ``fn`` takes when called with positional arguments alone (through a
    ``functools.partial`` too) and, if it asks for it, the keyword-only ``state``; None when that
    cannot be one number (``*args``, another keyword-only argument it requires, no readable signature)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL or (p.kind is p.KEYWORD_ONLY and p.default is p.empty and p.name != STATE)
           for p in params):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


@functools.cache
def takes_state(fn: Callable[..., Any]) -> bool:
    """Whether the hook ``fn`` asks for its plan's per-job state (a keyword-only ``state``)."""
    try:
        param = inspect.signature(fn).parameters.get(STATE)
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind is param.KEYWORD_ONLY


def _what(name: str, value: Any, module: str) -> str:
    """How a check's message names a value: where it comes from, whatever the name it is bound to."""
    if isinstance(value, functools.partial):
        return f"a functools.partial of {_what(name, value.func, module)}"
    origin = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    if inspect.isfunction(value) or inspect.isbuiltin(value):
        if value.__module__ == module and value.__name__ == name:
            return "a function"
        return f"{origin}, under the name {name}" if value.__name__ != name else f"{origin}, imported"
    return f"a {type(value).__name__}"


def _near(name: str) -> str | None:
    """The hook or constant ``name`` is likely a misspelling of (build_optimiser, Options), or None."""
    known = [*HOOKS, *CONSTANTS]
    same = [k for k in known if k.lower() == name.lower() and k != name]
    close = [k for k in difflib.get_close_matches(name, known, n=1, cutoff=0.8) if k != name]
    return (same or close or [None])[0]


def _problem(name: str, value: Any, helpers: tuple[str, ...], module: str) -> str | None:
    """Why the public name ``name`` of a strategy module breaks the contract, or None."""
    if name in HOOKS:
        got = positional_arity(value) if callable(value) and not inspect.isclass(value) else -1
        if got == HOOKS[name]:
            return None
        takes = ("is not a function" if got == -1 else f"takes {got} argument(s)" if got is not None
                 else "takes arguments that cannot be counted (*args, a keyword it requires other than state, or no "
                 "signature)")
        return (f"the hook {name} ({_what(name, value, module)}) {takes}; the contract ({CONTRACT}) calls it with "
                f"{HOOKS[name]}: give it exactly those, or rename it if it is not meant as this hook.")
    if name in CONSTANTS:
        wanted = CONSTANTS[name]
        if not isinstance(value, wanted) or (wanted is tuple and not all(isinstance(v, str) for v in value)):
            shape = "a tuple of names" if wanted is tuple else f"a {wanted.__name__}"
            return f"{name} must be {shape} (it is {value!r}: {_what(name, value, module)})."
        return None
    near = _near(name)
    if name in helpers or (not near and (inspect.isclass(value) or (name.isupper() and not callable(value)))):
        return None  # a declared helper, a class (a type it uses or defines), a constant of its own
    hint = f": did you mean {near}? (a misspelt one would be ignored, and the default used)" if near else ""
    return (f"defines {name} ({_what(name, value, module)}), which is not a hook, a constant or a declared helper"
            f"{hint}. A hook is named as in the table of {CONTRACT}; a constant's name is upper-case; a helper is "
            f"named in the module's HELPERS, or made private (_{name}).")


def check_module(module: Any) -> None:
    """Refuse a strategy module with a public name that is not a hook (of the contract's arity), a
    constant (upper-case; the contract's of their types) or a helper named in ``HELPERS`` -- whatever its
    origin: defined there, imported, an alias, a ``functools.partial``. Modules, classes and
    ``from __future__`` imports are allowed."""
    where = f"{module.__name__.replace('.', '/')}.py"
    names = vars(module)
    if not callable(names.get("wrap")):
        raise ConfigError(f"{where} defines no wrap(model, info, cfg): every strategy must.")
    helpers = names.get("HELPERS", ())
    for name, value in names.items():
        if not name.startswith("_") and not inspect.ismodule(value) and type(value).__module__ != "__future__":
            problem = _problem(name, value, helpers if isinstance(helpers, tuple) else (), module.__name__)
            if problem:
                raise ConfigError(f"{where} {problem}" if problem.startswith("defines") else f"{where}: {problem}")
    for name in helpers:
        if name not in names or name in HOOKS or name in CONSTANTS or name.startswith("_"):
            why = ("is a hook or a constant, not a helper" if name in HOOKS or name in CONSTANTS
                   else "is private" if name.startswith("_") else "is not defined there")
            raise ConfigError(f"{where}: HELPERS names {name}, which {why}; list only the module's public helpers.")


@functools.cache
def _module(name: str) -> Any:
    """The module of ``--strategy=name``, imported and checked once (a plan holds no state of it)."""
    module = importlib.import_module(f"{__name__}.{name}")
    check_module(module)
    return module


class Strategy:
    """One job's plan: the hooks of ``ddp_course/parallel/<name>.py`` (or the defaults above), and the
    state they keep for this job (:attr:`state`). A fresh one per job (:func:`plan_for`); it wraps one model."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.module = _module(name)
        self.state: dict[str, Any] = {}  # what its hooks keep for this job (written by wrap), never the model
        self._wrapped = False

    def __repr__(self) -> str:
        return f"Strategy({self.name!r})"

    def _hook(self, name: str, default: Callable[..., Any]) -> Callable[..., Any]:
        hook = getattr(self.module, name, None)
        if hook is None:
            return default
        return functools.partial(hook, state=self.state) if takes_state(hook) else hook

    @property
    def needs_process_group(self) -> bool:
        return bool(getattr(self.module, "NEEDS_PROCESS_GROUP", True))

    def refusal(self, distributed: bool, world_size: int) -> str | None:
        """Why a process cannot run this strategy, or None: started without torchrun though it needs a
        process group, or one of several ranks though it runs in one process."""
        if self.needs_process_group and not distributed:
            example = getattr(self.module, "LAUNCH_EXAMPLE",
                              f"--nproc_per_node=2 -m ddp_course.train --strategy={self.name}")
            nproc, _, flags = example.partition(" -m ddp_course.train ")
            return (f"--strategy={self.name} needs a process group, and this process was not started by torchrun: "
                    f"launch with `torchrun --standalone {example}` (or `python -m ddp_course run "
                    f"--nproc={nproc.partition('=')[2]} {flags}`; in a notebook, ddp_course.launch.run).")
        if not self.needs_process_group and world_size > 1:
            return (f"--strategy={self.name} runs in one process, but this job has {world_size} ranks: every rank "
                    "would train a model of its own on the same devices. Launch one process (python -m "
                    f"ddp_course.train --strategy={self.name}; in a notebook, ddp_course.launch.run(..., nproc=1)), "
                    "or use --strategy=ddp with torchrun for one process per device.")
        return None

    def wrap(self, model: nn.Module, info: DistInfo, cfg: TrainConfig) -> nn.Module:
        why = self.refusal(info.is_distributed, info.world_size)
        if why:
            raise ConfigError(why)
        if self._wrapped:
            raise RuntimeError(f"{self!r} has wrapped a model already: a plan is one job's, and holds that job's "
                               "state. Build a fresh one for another model (parallel.plan_for(cfg)).")
        return self.note(self._hook("wrap", self.module.wrap)(model, info, cfg))

    def note(self, wrapped: nn.Module) -> nn.Module:
        """Record that ``wrapped`` is this plan's (:func:`strategy_of` finds it); returns it."""
        self._wrapped = True
        _WRAPPED[wrapped] = self
        return wrapped

    def build_optimizer(self, model: nn.Module, cfg: Any, device: torch.device) -> torch.optim.Optimizer:
        return self._hook("build_optimizer", adamw)(model, cfg, device)

    def sync_context(self, model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        if sync:  # a micro-step that synchronises runs as it would without accumulation
            return contextlib.nullcontext()
        return self._hook("sync_context", lambda model, sync: contextlib.nullcontext())(model, sync)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return self._hook("clip_grad_norm_", lambda m, n: torch.nn.utils.clip_grad_norm_(m.parameters(), n))(
            model, max_norm)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return without_compile(self._hook("unwrap", without_compile)(model))

    def gathered(self, model: nn.Module) -> nn.Module:
        return self._hook("gathered", self.unwrap)(model)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                   options: StateDictOptions | None = None) -> tuple[dict, dict]:
        return self._hook("state_dict", DCP.state_dict)(model, optimizer, options)

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict,
                        options: StateDictOptions | None = None) -> None:
        self._hook("load_state_dict", DCP.load_state_dict)(model, optimizer, model_sd, optim_sd, options)

    def has_state(self, optimizer: torch.optim.Optimizer) -> bool:
        return bool(self._hook("has_state", DCP.has_state)(optimizer))

    def devices_per_rank(self, model: nn.Module) -> int:
        return int(self._hook("devices_per_rank", lambda model: 1)(model))

    def data_parallel(self, rank: int, world_size: int, cfg: Any) -> tuple[int, int]:
        dp_rank, dp_size = self._hook("data_parallel", lambda rank, world_size, cfg: (rank, world_size))(
            rank, world_size, cfg)
        return int(dp_rank), int(dp_size)

    def model_state_dict(self, model: nn.Module, options: StateDictOptions | None = None) -> dict:
        return self._hook("model_state_dict", DCP.model_state_dict)(model, options)

    @property
    def forward_backward(self) -> Callable[..., torch.Tensor] | None:
        """The strategy's own forwards and backwards of a step (a pipeline schedule), or None: the
        training loop's (``train.train_step``)."""
        hook = getattr(self.module, "forward_backward", None)
        return None if hook is None else self._hook("forward_backward", hook)


def plan_for(cfg: TrainConfig) -> Strategy:
    """A fresh plan for the job ``cfg`` describes (``--strategy``), its state empty: build it once per
    job and hand it on."""
    return Strategy(cfg.strategy)


@functools.cache
def _plain() -> Strategy:
    """The plan of a model nobody wrapped here: ``single``'s, which keeps no state (never wraps)."""
    return Strategy("single")


def one_process() -> tuple[str, ...]:
    """The strategies that run in one process, without a process group (``NEEDS_PROCESS_GROUP = False``)."""
    from ddp_course.config import available_strategies

    return tuple(name for name in available_strategies() if not Strategy(name).needs_process_group)


def wrap(model: nn.Module, info: DistInfo, cfg: TrainConfig) -> nn.Module:
    """Apply ``cfg.strategy`` (``ddp_course.parallel.<strategy>.wrap``) to the model with a fresh plan,
    which :func:`strategy_of` finds from the wrapper."""
    return plan_for(cfg).wrap(model, info, cfg)


def record(model: nn.Module, name: str) -> nn.Module:
    """Note that ``model`` is strategy ``name``'s wrapper, built by hand (a lesson that calls
    ``DistributedDataParallel(...)`` itself, then the course's ``train_step``), under a fresh plan;
    returns it. A strategy whose hooks read what its ``wrap`` kept cannot be built by hand."""
    plan = Strategy(name)
    if takes_state(plan.module.wrap):
        raise ConfigError(f"--strategy={name}'s wrap keeps what its other hooks need in its plan: a wrapper built "
                          f"by hand would lack it. Wrap with parallel.wrap(model, info, cfg) (or a plan's wrap).")
    return plan.note(model)


def strategy_of(model: nn.Module) -> Strategy:
    """The plan that wrapped ``model`` (:func:`wrap`, :func:`record`; under ``torch.compile`` too), or
    the defaults (``single``) for a plain model."""
    return _WRAPPED.get(model) or _WRAPPED.get(without_compile(model)) or _plain()


# --- the plan of a wrapped model, as plain functions (what the training loop calls) ----------------

def sync_context(model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """The strategy's context for a micro-step that must not synchronise (``sync=False``), else a no-op.

    DDP's is ``model.no_sync()``, which DDP reads when the *forward* runs: the forward of every
    non-final micro-step must be inside this context, not only its backward. FSDP2's is
    ``set_requires_gradient_sync(False)`` (no reduce-scatter; unsharded gradients accumulate locally).
    """
    return strategy_of(model).sync_context(model, sync)


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (over every rank's shard, for FSDP); returns the norm before clipping."""
    return strategy_of(model).clip_grad_norm_(model, max_norm)


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside the strategy's wrapper and ``torch.compile``'s (for saving, sampling).

    FSDP2 shards in place: the model is its own plain self, but its parameters are shards; use
    the plan's ``gathered`` for a copy with full parameters.
    """
    inner = without_compile(model)  # torch.compile(DDP(model)) as well as DDP(torch.compile(model))
    return strategy_of(inner).unwrap(inner)
