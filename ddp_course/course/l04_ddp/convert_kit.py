"""What exercise 04 (``exercises/04_ddp_convert.py``) takes from the course, and the recipe shares with it.

The data (the first windows of the corpus, each with its index, so that a run records which windows a
rank trained on) and the model (a MiniGPT from a seed). ``clean_exit`` is here too, the course's
workaround for an abort at exit around ``init_process_group`` (``ddp_course.dist``), so that the exercise
imports nothing else of the course: the recipe (``ddp_recipe``) and ``ddp_course.dist`` hold the
course's own versions of what the exercise asks for (``setup``, ``mean_over_ranks``), and the exercise's
grader refuses an answer that calls them (its ``DELEGATES``).
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from ddp_course.data import TokenWindows, prepare
from ddp_course.dist import clean_exit
from ddp_course.model import GPTConfig, MiniGPT

__all__ = ["IndexedWindows", "build_model", "clean_exit", "small_data"]


class IndexedWindows(Dataset):
    """``TokenWindows`` that also return the window's index, so that a run can record which windows
    each rank trained on (the lesson shows them; the recipe does not need them)."""

    def __init__(self, windows: TokenWindows, n: int):
        if n > len(windows):
            raise ValueError(f"asked for {n} windows but the split has only {len(windows)}")
        self.windows, self.n = windows, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        x, y = self.windows[i]
        return i, x, y


def small_data(corpus: str, block_size: int, train_windows: int, val_windows: int):
    """(train, val, vocab_size): the first windows of the corpus' train and validation splits."""
    data = prepare(corpus, block_size, val_fraction=0.1, announce=lambda m: print(m, flush=True))
    return (IndexedWindows(data.train, train_windows), IndexedWindows(data.val, val_windows),
            data.tokenizer.vocab_size)


def build_model(vocab_size: int, seed: int, *, block_size: int, n_layer: int, n_head: int, n_embd: int) -> MiniGPT:
    """A MiniGPT initialised from ``seed``: the same seed gives the same weights in every process."""
    torch.manual_seed(seed)
    return MiniGPT(GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                             n_embd=n_embd))
