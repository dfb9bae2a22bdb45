"""The corpus, a character tokenizer, the token-stream dataset every lesson trains on, each rank's
batches (a sampler's, or a stream's), and :class:`DataPosition`, where a rank's stream stands.

Where the text comes from, in order:
1. ``$DDP_COURSE_DATA/tinyshakespeare.txt`` if that variable names a directory holding the file;
2. the user cache (``$XDG_CACHE_HOME/ddp_course`` or ``~/.cache/ddp_course``);
3. a download from the public char-rnn repository, checked against its SHA-256, into the cache;
4. offline fallback: the documentation text every Python ships (``pydoc_data.topics``), announced
   in one line. The course never crashes for want of a network and never switches silently.
"""

from __future__ import annotations

import hashlib
import os
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_FILE = "tinyshakespeare.txt"
Batch = Sequence[torch.Tensor]  # (x, y): token ids and their next-token targets, each (B, T)


class CorpusError(RuntimeError):
    """The requested corpus cannot be read. The message says what to do."""


@dataclass(frozen=True)
class Corpus:
    name: str  # "tinyshakespeare", "offline" or the path given
    text: str
    source: str  # where it was read from, for the first log line


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddp_course"


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _download(url: str, dest: Path, sha256: str, timeout: float = 10.0) -> None:
    """Download to a temporary name, check the hash, then rename (never a half-written file)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_suffix(dest.suffix + f".part{os.getpid()}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            tmp.write_bytes(resp.read())
        got = sha256_of(tmp)
        if got != sha256:
            raise CorpusError(f"downloaded {url} but its SHA-256 is {got}, expected {sha256}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def offline_text() -> str:
    """A corpus every CPython ships: the text of the interactive help topics (about 0.5 MB on CPython 3.11)."""
    from pydoc_data import topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def find_shakespeare(download: bool = True) -> tuple[Path | None, str]:
    """Locate (or fetch) tinyshakespeare.txt. Returns (path or None, why not found)."""
    env_dir = os.environ.get("DDP_COURSE_DATA")
    if env_dir:
        candidate = Path(env_dir) / SHAKESPEARE_FILE
        if candidate.is_file():
            return candidate, ""
        reason = f"DDP_COURSE_DATA={env_dir} holds no {SHAKESPEARE_FILE}"
    else:
        reason = "DDP_COURSE_DATA is not set"
    cached = cache_dir() / SHAKESPEARE_FILE
    if cached.is_file() and sha256_of(cached) == SHAKESPEARE_SHA256:
        return cached, ""
    if not download:
        return None, reason + "; not in the cache; download disabled"
    try:
        _download(SHAKESPEARE_URL, cached, SHAKESPEARE_SHA256)
        return cached, ""
    except (OSError, CorpusError) as exc:  # URLError is an OSError
        return None, f"{reason}; not in {cached.parent}; download failed ({exc})"


def load_corpus(name: str = "tinyshakespeare", announce: Callable[[str], object] = print) -> Corpus:
    """Return the corpus text. ``name`` is tinyshakespeare, offline, or a path to a text file."""
    if name == "offline":
        return Corpus("offline", offline_text(), "pydoc_data.topics (ships with Python)")
    if name == "tinyshakespeare":
        path, why = find_shakespeare()
        if path is not None:
            return Corpus(name, path.read_text(encoding="utf-8"), str(path))
        announce(f"[data] Tiny Shakespeare unavailable ({why}); falling back to the offline corpus "
                 f"pydoc_data.topics. Put {SHAKESPEARE_FILE} in a directory and set DDP_COURSE_DATA to use it.")
        return Corpus("offline", offline_text(), "pydoc_data.topics (offline fallback)")
    path = Path(name).expanduser()
    if not path.is_file():
        raise CorpusError(f"--corpus={name!r} is neither 'tinyshakespeare', 'offline' nor an existing text file. "
                          "Give a path to a UTF-8 text file, or use --corpus=tinyshakespeare.")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CorpusError(f"--corpus={name!r} is not UTF-8 text ({exc}).") from None
    if len(text) < 1000:
        raise CorpusError(f"--corpus={name!r} has only {len(text)} characters; give at least a few thousand.")
    return Corpus(str(path), text, str(path))


def check_corpus(name: str) -> None:
    """Raise :class:`CorpusError` when ``name`` is not a corpus :func:`load_corpus` can read, before any
    job starts (tinyshakespeare and offline always can: the first falls back to the second)."""
    if name not in ("offline", "tinyshakespeare"):
        load_corpus(name, announce=lambda _line: None)


class CharTokenizer:
    """One token per distinct character of the corpus (vocabulary sorted, so it is reproducible)."""

    def __init__(self, chars: str) -> None:
        self.chars = "".join(sorted(set(chars)))
        self.stoi = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        return cls(text)

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def encode_tensor(self, text: str) -> torch.Tensor:
        """:meth:`encode` as one int64 tensor, computed for every character at once (each character's code
        point looked up in a table of the vocabulary's). A corpus of a million characters takes
        milliseconds instead of the list's fraction of a second, which every rank of every job would
        pay at start-up."""
        if not text:
            return torch.zeros(0, dtype=torch.long)
        points = torch.frombuffer(bytearray(text.encode("utf-32-le")), dtype=torch.int32)
        codes = torch.tensor([ord(c) for c in self.chars], dtype=torch.long)
        table = torch.full((max(int(points.max()), int(codes.max())) + 1,), -1, dtype=torch.long)
        table[codes] = torch.arange(len(codes))
        ids = table[points.long()]
        unknown = ids < 0
        if unknown.any():
            raise ValueError(f"character {chr(int(points[unknown][0]))!r} is not in the vocabulary")
        return ids

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)


def split_tokens(tokens: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Train on the head of the stream, validate on the tail (no window crosses the cut)."""
    n_val = int(len(tokens) * val_fraction)
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]


class TokenWindows(Dataset):
    """Window i is ``x = tokens[s : s+T]`` and ``y = tokens[s+1 : s+T+1]`` with ``s = i * stride``.

    The target is the input shifted by one: the model learns to predict every next character.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int | None = None) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.stride = stride or block_size
        if len(tokens) < block_size + 1:
            raise ValueError(f"{len(tokens)} tokens cannot fill one window of {block_size} + 1")

    def __len__(self) -> int:
        return (len(self.tokens) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        s = i * self.stride
        chunk = self.tokens[s: s + self.block_size + 1]
        return chunk[:-1], chunk[1:]


@dataclass
class Data:
    corpus: Corpus
    tokenizer: CharTokenizer
    train: TokenWindows
    val: TokenWindows


def prepare(corpus: str, block_size: int, val_fraction: float, announce: Callable[[str], object] = print) -> Data:
    """The corpus, its character tokenizer, and the train/validation windows of ``block_size`` tokens."""
    c = load_corpus(corpus, announce=announce)
    tok = CharTokenizer.from_text(c.text)
    ids = tok.encode_tensor(c.text)
    train_ids, val_ids = split_tokens(ids, val_fraction)
    return Data(c, tok, TokenWindows(train_ids, block_size), TokenWindows(val_ids, block_size))


class DataPosition:
    """Where this rank's stream of micro-batches stands: a checkpoint's ``position``, saved and read back
    by itself (``state_dict`` / ``load_state_dict``, as ``checkpoint.TrainState``'s parts are).

    ``micro_batches`` counts this rank's micro-batches drawn; the training loop advances it as it
    draws. Saved as ``samples`` (sequences seen by all ranks together), which does not depend on the
    world size: a job resumed at another world size continues from the first sample not yet seen (every
    world size's sampler walks the same shuffled order of the epoch, split over the ranks).
    ``epoch`` / ``batch_in_epoch`` locate it inside the sampler's epochs (``batches_per_epoch``).
    """

    def __init__(self, micro_batch_size: int, world_size: int, batches_per_epoch: int | None = None,
                 micro_batches: int = 0) -> None:
        self.micro_batch_size, self.world_size = micro_batch_size, world_size
        self.batches_per_epoch, self.micro_batches = batches_per_epoch, micro_batches

    def advance(self, n: int) -> None:
        """``n`` more micro-batches drawn."""
        self.micro_batches += n

    def state_dict(self) -> dict[str, int]:
        mb, per_epoch = self.micro_batches, self.batches_per_epoch
        epoch, batch = divmod(mb, per_epoch) if per_epoch else (0, mb)
        return {"samples": mb * self.micro_batch_size * self.world_size, "micro_batches": mb, "epoch": epoch,
                "batch_in_epoch": batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue after the samples ``state`` had seen, at this job's micro-batch size and world size."""
        self.micro_batches = int(state["samples"]) // (self.micro_batch_size * self.world_size)


def train_sampler(ds: Dataset, rank: int, world_size: int, seed: int) -> DistributedSampler:
    """Shuffled, disjoint shards, one per rank; ``set_epoch(e)`` reshuffles (call it every epoch).

    A one-process run uses the same sampler with one replica, so it sees, in one batch, exactly the
    samples that the ranks of a DDP run see together: that is what makes the runs comparable.
    ``drop_last=True`` keeps every rank at the same number of batches (no rank waits forever).
    """
    return DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)


def train_batches(ds: Dataset, batch_size: int, rank: int, world_size: int, seed: int,
                  start_batch: int = 0, num_workers: int = 0, pin_memory: bool = False) -> Iterator[Batch]:
    """Yield this rank's (x, y) batches forever, epoch after epoch, starting at global batch index
    ``start_batch`` (so a resumed run continues mid-epoch). Shuffle lives in the sampler, never in
    the DataLoader."""
    sampler = train_sampler(ds, rank, world_size, seed)
    per_epoch = len(sampler) // batch_size
    if per_epoch == 0:
        raise ValueError(f"the training set has {len(ds)} windows: too few for batches of {batch_size} "
                         f"on {world_size} rank(s). Use a smaller --micro_batch_size or --block_size.")
    epoch, skip = divmod(start_batch, per_epoch)
    while True:
        sampler.set_epoch(epoch)
        indices = list(sampler)[skip * batch_size:]
        loader = DataLoader(ds, batch_size=batch_size, sampler=indices, drop_last=True,
                            num_workers=num_workers, pin_memory=pin_memory)
        yield from loader
        epoch, skip = epoch + 1, 0


def stream_offsets(n_tokens: int, block_size: int, batch_size: int, rank: int, world_size: int, seed: int,
                   start_batch: int = 0) -> Iterator[torch.Tensor]:
    """This rank's window start offsets, batch after batch, forever: the streaming alternative.

    Every rank owns a generator seeded with the same ``seed``; each step it draws the start offsets
    of the whole global batch (``world_size * batch_size`` positions anywhere in the token stream)
    and keeps slice ``rank`` of them (rank-offset windows). The ranks' slices are disjoint pieces of
    one draw, so together they are exactly the batch one process with ``world_size * batch_size``
    draws. No sampler, no epochs, nothing to forget to call; windows are drawn with replacement.
    (Seeding each rank with ``seed + rank`` and drawing only its own slice also gives every rank
    different data, but then no single-process run reproduces the DDP run.)
    """
    span = n_tokens - block_size  # a window needs block_size + 1 tokens: starts 0 .. n - block_size - 1
    if span < 1:
        raise ValueError(f"{n_tokens} tokens cannot fill one window of {block_size} + 1")
    g = torch.Generator().manual_seed(seed)
    for _ in range(start_batch):  # a resumed run skips the draws the finished steps consumed
        torch.randint(span, (world_size * batch_size,), generator=g)
    while True:
        starts = torch.randint(span, (world_size * batch_size,), generator=g)
        yield starts[rank * batch_size:(rank + 1) * batch_size]


def stream_batches(tokens: torch.Tensor, block_size: int, batch_size: int, rank: int, world_size: int,
                   seed: int, start_batch: int = 0, pin_memory: bool = False) -> Iterator[Batch]:
    """Yield this rank's (x, y) batches of windows at the offsets of :func:`stream_offsets`.

    ``pin_memory`` (for a GPU) puts each batch in page-locked memory, as the DataLoader's option of
    that name does, so that ``.to(device, non_blocking=True)`` copies it while the GPU computes.
    """
    for starts in stream_offsets(len(tokens), block_size, batch_size, rank, world_size, seed, start_batch):
        x = torch.stack([tokens[s: s + block_size] for s in starts.tolist()])
        y = torch.stack([tokens[s + 1: s + block_size + 1] for s in starts.tolist()])
        yield (x.pin_memory(), y.pin_memory()) if pin_memory else (x, y)


def val_batches(ds: Dataset, batch_size: int, n_batches: int, rank: int, world_size: int) -> list[Batch]:
    """A fixed validation subset, split across ranks (rank r takes windows r, r+W, ...)."""
    n = min(len(ds), batch_size * n_batches * world_size)
    idx = list(range(rank, n, world_size))
    loader = DataLoader(ds, batch_size=batch_size, sampler=idx, drop_last=False)
    return list(loader)
