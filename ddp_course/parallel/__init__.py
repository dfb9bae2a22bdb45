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
``OPTIONS``              the ``TrainConfig`` fields that are its own  ``()``
                         (``--help`` lists them under the strategy;
                         another's: ``OPTIONS = ddp.OPTIONS``)
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
=======================  ==========================================  =========================================

A module's other public functions are its own helpers; one whose name is close to a hook's
(``build_optimiser``) is refused when the strategy is loaded, as is a hook that takes other
arguments than the table says (:class:`StrategyModule` spells the contract for a type checker).
Whether a process can run the strategy at all (started by torchrun or not, how many ranks) is
decided in one place, :meth:`Strategy.refusal`, from ``NEEDS_PROCESS_GROUP``; a module may give
``LAUNCH_EXAMPLE``, the torchrun arguments the refusal suggests.

The training job looks its plan up once (:func:`get`) and holds it: it wraps, builds the optimizer,
steps and samples through it, and hands it to ``checkpoint`` (which never looks it up). Code that
only holds a wrapped model (a lesson calling ``train_step``) finds its plan with :func:`strategy_of`
(:meth:`Strategy.wrap` records it; a wrapper built by hand is recorded with :func:`record`): nothing
asks the model which wrapper it is. A model nobody wrapped here gets the defaults, right for a plain
model. ``checkpoint`` uses PyTorch's state dicts unless handed ``plan=``; a model wrapped by a strategy
with state-dict hooks of its own (ZeRO-1, FSDP x TP) is refused there without its plan.
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

from ddp_course.checkpoint import DCP, OWN_STATES
from ddp_course.config import ConfigError, TrainConfig
from ddp_course.dist import DistInfo

_WRAPPED: weakref.WeakKeyDictionary[nn.Module, Strategy] = weakref.WeakKeyDictionary()


def decay_groups(model: nn.Module, cfg: Any, ndims: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """AdamW's two parameter groups: weight decay on matrices (2-D or more), none on biases and gains.

    ``ndims``: each parameter's number of dimensions by its name in ``model.named_parameters()``, when
    the wrapper shows them otherwise than the model defined them (FSDP1's flat 1-D shards).
    """
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (decay if (ndims[name] if ndims is not None else p.dim()) >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw_options(cfg: Any, device: torch.device) -> dict[str, Any]:
    """The course's AdamW settings: ``cfg.lr``, betas (0.9, 0.95), the fused kernel on CUDA.

    On CPU, PyTorch's default path (one tensor at a time) is kept, so CPU results stay comparable
    across the torch versions the course supports.
    """
    return {"lr": cfg.lr, "betas": (0.9, 0.95), "fused": device.type == "cuda"}


def adamw(model: nn.Module, cfg: Any, device: torch.device, ndims: dict[str, int] | None = None
          ) -> torch.optim.AdamW:
    """The default optimizer: AdamW over :func:`decay_groups` with :func:`adamw_options`."""
    return torch.optim.AdamW(decay_groups(model, cfg, ndims), **adamw_options(cfg, device))


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
    OPTIONS: tuple[str, ...]

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


# every hook, with the number of arguments it takes (StrategyModule's methods, less ``self``)
HOOKS: dict[str, int] = {name: len(inspect.signature(fn).parameters) - 1
                         for name, fn in vars(StrategyModule).items() if inspect.isfunction(fn) and name[0] != "_"}
CONSTANTS = ("NEEDS_PROCESS_GROUP", "LAUNCH_EXAMPLE", "OPTIONS")
STATE_HOOKS = ("state_dict", "load_state_dict", "model_state_dict", "has_state")  # what checkpoint asks


def check_module(module: Any) -> None:
    """Refuse a strategy module whose public names look like a hook or a constant but are not one
    (a misspelling would silently get the default), or whose hooks take other arguments."""
    where = f"{module.__name__.replace('.', '/')}.py"
    if not callable(vars(module).get("wrap")):
        raise ConfigError(f"{where} defines no wrap(model, info, cfg): every strategy must.")
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        if inspect.isfunction(value) and value.__module__ == module.__name__:
            if name in HOOKS:
                wanted, got = HOOKS[name], len(inspect.signature(value).parameters)
                if got != wanted:
                    raise ConfigError(f"{where}: the hook {name} takes {got} argument(s); the contract "
                                      f"(ddp_course/parallel/__init__.py) gives it {wanted}.")
                continue
            near = difflib.get_close_matches(name, list(HOOKS), n=1, cutoff=0.8)
        elif name.isupper():
            near = [c for c in difflib.get_close_matches(name, CONSTANTS, n=1, cutoff=0.8) if c != name]
        else:
            continue
        if near:
            raise ConfigError(f"{where} defines {name}, which is not a hook: did you mean {near[0]}? "
                              "(ddp_course/parallel/__init__.py lists the hooks; a misspelt one would be ignored.)")


class Strategy:
    """One strategy's plan: the hooks of ``ddp_course/parallel/<name>.py``, or the defaults above."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.module = importlib.import_module(f"{__name__}.{name}")
        check_module(self.module)

    def __repr__(self) -> str:
        return f"Strategy({self.name!r})"

    def _hook(self, name: str, default: Callable[..., Any]) -> Callable[..., Any]:
        return getattr(self.module, name, default)

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
                    "would train a model of its own. Use --strategy=ddp with torchrun, or launch one process.")
        return None

    def wrap(self, model: nn.Module, info: DistInfo, cfg: TrainConfig) -> nn.Module:
        why = self.refusal(info.is_distributed, info.world_size)
        if why:
            raise ConfigError(why)
        return self.note(self.module.wrap(model, info, cfg))

    def note(self, wrapped: nn.Module) -> nn.Module:
        """Record that ``wrapped`` is this strategy's (:func:`strategy_of` finds it; checkpoint refuses it
        without this plan when the strategy reads its states with hooks of its own); returns it."""
        _WRAPPED[wrapped] = self
        if any(callable(vars(self.module).get(hook)) for hook in STATE_HOOKS):
            OWN_STATES[wrapped] = self.name
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


@functools.cache
def get(name: str) -> Strategy:
    """The plan of ``--strategy=name`` (its module is imported here, once)."""
    return Strategy(name)


def one_process() -> tuple[str, ...]:
    """The strategies that run in one process, without a process group (``NEEDS_PROCESS_GROUP = False``)."""
    from ddp_course.config import available_strategies

    return tuple(name for name in available_strategies() if not get(name).needs_process_group)


def wrap(model: nn.Module, info: DistInfo, cfg: TrainConfig) -> nn.Module:
    """Apply ``cfg.strategy`` (``ddp_course.parallel.<strategy>.wrap``) to the model and record its plan."""
    return get(cfg.strategy).wrap(model, info, cfg)


def record(model: nn.Module, name: str) -> nn.Module:
    """Note that ``model`` is strategy ``name``'s wrapper, built by hand (a lesson that calls
    ``DistributedDataParallel(...)`` itself, then the course's ``train_step``); returns it."""
    return get(name).note(model)


def strategy_of(model: nn.Module) -> Strategy:
    """The plan that wrapped ``model`` (:func:`wrap`, :func:`record`; under ``torch.compile`` too), or
    the defaults (``single``) for a plain model."""
    return _WRAPPED.get(model) or _WRAPPED.get(without_compile(model)) or get("single")


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
    :func:`gathered` for a copy with full parameters.
    """
    inner = without_compile(model)  # torch.compile(DDP(model)) as well as DDP(torch.compile(model))
    return strategy_of(inner).unwrap(inner)


def gathered(model: nn.Module) -> nn.Module:
    """The model with full parameters, for sampling: itself when replicated, a plain copy when sharded.

    For FSDP this is a collective (the full parameters are all-gathered): every rank must call it.
    """
    return strategy_of(model).gathered(model)
