"""What a pipeline stage holds for its backward, counted: the lesson's schedules and the 1F1B exercise
measure their activations with :class:`SavedBytes` (it holds no schedule of its own)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class SavedBytes:
    """Bytes of the tensors autograd holds for backward, live, per stage (parameters excluded).

    Inside ``hooks()`` every tensor a forward saves is packed into a ``_Held``, which adds its bytes to
    the current stage's count; autograd frees the ``_Held`` when it no longer needs it (after the
    backward that used it, or with the graph), which takes them off. A storage saved twice is counted
    once. ``peak[stage]`` is the largest count a stage reached.
    """

    def __init__(self, params: set[int]) -> None:
        self.params = params  # data_ptr of every parameter: weights are not activations
        self.stage = -1
        self.live: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self._refs: dict[tuple[int, int], list[int]] = {}  # (stage, storage ptr) -> [count, bytes]

    def reset_peak(self) -> None:
        self.peak = dict(self.live)

    def _add(self, stage: int, ptr: int, nbytes: int) -> None:
        ref = self._refs.setdefault((stage, ptr), [0, nbytes])
        ref[0] += 1
        if ref[0] == 1:
            self.live[stage] = self.live.get(stage, 0) + nbytes
            self.peak[stage] = max(self.peak.get(stage, 0), self.live[stage])

    def _drop(self, stage: int, ptr: int) -> None:
        ref = self._refs[(stage, ptr)]
        ref[0] -= 1
        if ref[0] == 0:
            del self._refs[(stage, ptr)]
            self.live[stage] -= ref[1]

    @contextmanager
    def hooks(self) -> Iterator[None]:
        counter = self

        class _Held:
            __slots__ = ("t", "stage", "ptr")

            def __init__(self, t: torch.Tensor) -> None:
                # detached: the same storage without its autograd history. Holding ``t`` itself would
                # make a saved output refer to its own grad_fn (a cycle that only gc breaks), and what
                # autograd let go of would be counted as held until then
                self.t, self.stage, self.ptr = t.detach(), counter.stage, t.untyped_storage().data_ptr()
                counter._add(self.stage, self.ptr, t.untyped_storage().nbytes())

            def __del__(self) -> None:
                counter._drop(self.stage, self.ptr)

        def pack(t: torch.Tensor) -> Any:
            if t.untyped_storage().data_ptr() in counter.params or counter.stage < 0:
                return t
            return _Held(t)

        def unpack(held: Any) -> torch.Tensor:
            return held.t if isinstance(held, _Held) else held

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
