"""Corpus lookup (offline, never the network), tokenizer, windows, samplers and resumable batches."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ddp_course import data
from ddp_course.data import (
    CharTokenizer,
    CorpusError,
    TokenWindows,
    load_corpus,
    split_tokens,
    train_batches,
    train_sampler,
)

# conftest.py points DDP_COURSE_DATA at the shared corpus; read it before any test empties it
_DATA_DIR = os.environ.get("DDP_COURSE_DATA")


def _shakespeare_dir() -> Path:
    if not _DATA_DIR or not (Path(_DATA_DIR) / data.SHAKESPEARE_FILE).is_file():
        pytest.skip("needs tinyshakespeare.txt in $DDP_COURSE_DATA")
    return Path(_DATA_DIR)


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a URL fails the test: these tests never touch the network."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a test tried to open a URL: {args!r}")
    monkeypatch.setattr(data.urllib.request, "urlopen", refuse)


@pytest.fixture
def empty_env(tmp_path, monkeypatch, no_network):
    """DDP_COURSE_DATA and the cache point at empty folders. Returns the cache folder."""
    (tmp_path / "data").mkdir()
    monkeypatch.setenv("DDP_COURSE_DATA", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "ddp_course"


# --- tokenizer --------------------------------------------------------------------------------------

def test_tokenizer_round_trip_and_sorted_vocabulary():
    text = "To be, or not to be: that is the question.\n"
    tok = CharTokenizer.from_text(text)
    assert tok.vocab_size == len(set(text))
    assert list(tok.chars) == sorted(set(text))
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text


def test_tokenizer_refuses_unknown_characters():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(ValueError, match="'z'"):
        tok.encode("abz")


# --- windows and split ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n, block, stride", [(100, 8, None), (101, 8, None), (9, 8, None), (100, 8, 3)])
def test_token_windows(n, block, stride):
    tokens = torch.arange(n)
    ds = TokenWindows(tokens, block, stride)
    step = stride or block
    assert len(ds) == (n - block - 1) // step + 1
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.shape == y.shape == (block,)
        assert x[0].item() == i * step
        assert torch.equal(y[:-1], x[1:])  # y is x shifted by one ...
        assert y[-1].item() == x[-1].item() + 1  # ... and its last element is the next token
    x, y = ds[len(ds) - 1]
    assert y[-1].item() <= n - 1  # the last window stays inside the stream
    with pytest.raises(IndexError):
        ds[len(ds)]
    with pytest.raises(IndexError):
        ds[-1]


def test_token_windows_need_one_full_window():
    with pytest.raises(ValueError):
        TokenWindows(torch.arange(8), 8)


@pytest.mark.parametrize("n, frac", [(1000, 0.1), (999, 0.25), (10, 0.05)])
def test_split_tokens_sizes(n, frac):
    tokens = torch.arange(n)
    train, val = split_tokens(tokens, frac)
    assert len(val) == int(n * frac)
    assert len(train) + len(val) == n
    assert torch.equal(torch.cat([train, val]), tokens)  # head trains, tail validates, nothing lost


# --- sampler and batches ----------------------------------------------------------------------------------

def _windows(n_windows: int, block: int = 4) -> TokenWindows:
    return TokenWindows(torch.arange(n_windows * block + 1), block)


def test_train_sampler_shards_are_disjoint_and_cover_the_truncated_permutation():
    ds = _windows(101)  # odd: drop_last must drop one window for two ranks
    seed = 7
    full = list(train_sampler(ds, 0, 1, seed))
    assert sorted(full) == list(range(len(ds)))  # one rank: a permutation of everything
    shards = [list(train_sampler(ds, r, 2, seed)) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == len(ds) // 2
    assert not set(shards[0]) & set(shards[1])
    kept = 2 * (len(ds) // 2)
    assert sorted(shards[0] + shards[1]) == sorted(full[:kept])
    assert shards[0] == full[0:kept:2] and shards[1] == full[1:kept:2]


def test_train_sampler_set_epoch_reshuffles():
    ds = _windows(64)
    s = train_sampler(ds, 0, 2, seed=3)
    s.set_epoch(0)
    e0 = list(s)
    s.set_epoch(1)
    e1 = list(s)
    s.set_epoch(0)
    assert list(s) == e0  # an epoch's order is reproducible
    assert e0 != e1
    full = train_sampler(ds, 0, 1, seed=3)
    full.set_epoch(1)
    assert sorted(full) == list(range(len(ds)))  # still a permutation after reshuffling


def _key(x: torch.Tensor) -> tuple:
    return tuple(x.tolist())


def test_ddp_ranks_together_see_the_single_process_batch():
    """World 2 with batch B on each rank == world 1 with batch 2B: the DDP equivalence rests on this."""
    ds = _windows(203)
    B, seed = 5, 11
    for step in range(3):  # the first few batches, not only the first
        ranks = [next(_nth(train_batches(ds, B, r, 2, seed), step)) for r in range(2)]
        single = next(_nth(train_batches(ds, 2 * B, 0, 1, seed), step))
        union = [_key(x) for xb, _ in ranks for x in xb]
        assert len(union) == 2 * B == len(set(union))
        assert set(union) == {_key(x) for x in single[0]}
        for (xb, yb) in [*ranks, single]:
            assert torch.equal(yb[:, :-1], xb[:, 1:])


def _nth(it, k):
    for _ in range(k):
        next(it)
    return it


@pytest.mark.parametrize("world, rank", [(1, 0), (2, 0), (2, 1)])
def test_start_batch_resumes_where_an_uninterrupted_iterator_is(world, rank):
    ds = _windows(50)
    B, seed = 4, 5
    per_epoch = (len(ds) // world) // B
    it = train_batches(ds, B, rank, world, seed)
    reference = [next(it) for _ in range(3 * per_epoch + 2)]  # crosses two epoch boundaries
    for k in (1, per_epoch - 1, per_epoch, per_epoch + 1, 2 * per_epoch + 3):
        x, y = next(train_batches(ds, B, rank, world, seed, start_batch=k))
        assert torch.equal(x, reference[k][0]) and torch.equal(y, reference[k][1]), k
    # and it keeps going in step afterwards
    resumed = train_batches(ds, B, rank, world, seed, start_batch=per_epoch - 1)
    for k in range(per_epoch - 1, per_epoch + 2):
        assert torch.equal(next(resumed)[0], reference[k][0])


def test_epochs_differ_and_each_epoch_uses_distinct_windows():
    ds = _windows(40)
    B = 4
    per_epoch = len(ds) // B
    it = train_batches(ds, B, 0, 1, seed=1)
    epochs = [[_key(x) for _ in range(per_epoch) for x in next(it)[0]] for _ in range(2)]
    assert len(set(epochs[0])) == per_epoch * B  # no window twice within an epoch
    assert epochs[0] != epochs[1]


def test_train_batches_too_small_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="micro_batch_size"):
        next(train_batches(_windows(6), 4, 0, 2, seed=0))


# --- the corpus ------------------------------------------------------------------------------------------

def test_corpus_from_ddp_course_data_with_the_pinned_hash(no_network):
    d = _shakespeare_dir()
    path = d / data.SHAKESPEARE_FILE
    messages: list[str] = []
    c = load_corpus("tinyshakespeare", announce=messages.append)
    assert c.name == "tinyshakespeare"
    assert Path(c.source) == path
    assert data.sha256_of(path) == data.SHAKESPEARE_SHA256
    assert c.text == path.read_text(encoding="utf-8")
    assert messages == []  # nothing to announce when the real corpus is found


def test_offline_fallback_is_announced_in_exactly_one_line(empty_env, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("network is unreachable (test)")
    monkeypatch.setattr(data, "_download", fail)
    messages: list[str] = []
    c = load_corpus("tinyshakespeare", announce=messages.append)
    assert c.name == "offline"
    assert c.text == data.offline_text() and len(c.text) > 100_000
    assert len(messages) == 1
    assert "\n" not in messages[0]
    assert "DDP_COURSE_DATA" in messages[0]
    assert "network is unreachable" in messages[0]  # the reason is passed on


def test_offline_corpus_by_name_announces_nothing(no_network):
    messages: list[str] = []
    c = load_corpus("offline", announce=messages.append)
    assert c.name == "offline" and messages == []


def test_corpus_from_the_cache_when_ddp_course_data_is_empty(empty_env):
    src = _shakespeare_dir() / data.SHAKESPEARE_FILE
    empty_env.mkdir(parents=True)
    (empty_env / data.SHAKESPEARE_FILE).write_bytes(src.read_bytes())
    c = load_corpus("tinyshakespeare", announce=pytest.fail)
    assert Path(c.source) == empty_env / data.SHAKESPEARE_FILE


def test_bad_corpus_paths_raise_a_clear_corpus_error(tmp_path, no_network):
    missing = tmp_path / "nope.txt"
    with pytest.raises(CorpusError) as exc:
        load_corpus(str(missing))
    msg = str(exc.value)
    assert str(missing) in msg and "tinyshakespeare" in msg and "offline" in msg
    short = tmp_path / "short.txt"
    short.write_text("hello", encoding="utf-8")
    with pytest.raises(CorpusError, match="only 5 characters"):
        load_corpus(str(short))
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00" * 1000)
    with pytest.raises(CorpusError, match="not UTF-8"):
        load_corpus(str(binary))
    ok = tmp_path / "ok.txt"
    ok.write_text("abc\n" * 500, encoding="utf-8")
    assert load_corpus(str(ok)).text == "abc\n" * 500


class _FakeResponse:
    def __init__(self, payload: bytes):
        self.payload = payload

    def read(self, *args) -> bytes:
        return self.payload

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_download_with_the_wrong_hash_is_refused_and_leaves_no_file(empty_env, monkeypatch):
    calls = []

    def fake_urlopen(url, timeout=None):
        calls.append(url)
        return _FakeResponse(b"not the works of Shakespeare\n" * 100)

    monkeypatch.setattr(data.urllib.request, "urlopen", fake_urlopen)
    dest = empty_env / data.SHAKESPEARE_FILE
    with pytest.raises(CorpusError, match="SHA-256"):
        data._download(data.SHAKESPEARE_URL, dest, data.SHAKESPEARE_SHA256)
    assert calls == [data.SHAKESPEARE_URL]
    assert list(empty_env.iterdir()) == []  # neither the file nor a partial download is left

    # through the public entry point: the bad download is reported and the offline corpus used
    messages: list[str] = []
    c = load_corpus("tinyshakespeare", announce=messages.append)
    assert c.name == "offline"
    assert len(messages) == 1 and "SHA-256" in messages[0]
    assert list(empty_env.iterdir()) == []


def test_download_with_the_right_hash_fills_the_cache(empty_env, monkeypatch):
    payload = (_shakespeare_dir() / data.SHAKESPEARE_FILE).read_bytes()
    monkeypatch.setattr(data.urllib.request, "urlopen", lambda url, timeout=None: _FakeResponse(payload))
    c = load_corpus("tinyshakespeare", announce=pytest.fail)
    cached = empty_env / data.SHAKESPEARE_FILE
    assert Path(c.source) == cached
    assert sorted(p.name for p in empty_env.iterdir()) == [data.SHAKESPEARE_FILE]  # no .part file left
    assert data.sha256_of(cached) == data.SHAKESPEARE_SHA256


def test_prepare_builds_consistent_train_and_val_windows(no_network):
    _shakespeare_dir()
    d = data.prepare("tinyshakespeare", block_size=16, val_fraction=0.1, announce=pytest.fail)
    n = len(d.corpus.text)
    assert len(d.train.tokens) + len(d.val.tokens) == n
    assert len(d.val.tokens) == int(n * 0.1)
    assert d.tokenizer.decode(d.train.tokens[:100]) == d.corpus.text[:100]
    assert d.tokenizer.decode(d.val.tokens[-100:]) == d.corpus.text[-100:]


def test_a_resumed_position_goes_on_counting_what_this_job_draws():
    """A checkpoint's position is in samples (all ranks together), so a job with another micro-batch or
    world size continues after the same sample, and then counts its own micro-batches from there."""
    saved = data.DataPosition(micro_batch_size=8, world_size=2, batches_per_epoch=15)
    saved.advance(10 * 2)  # 10 steps of 2 micro-batches: 320 samples
    assert saved.state_dict() == {"samples": 320, "micro_batches": 20, "epoch": 1, "batch_in_epoch": 5}
    resumed = data.DataPosition(micro_batch_size=4, world_size=1)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.micro_batches == 80  # the 81st micro-batch of 4 is the 321st sample
    resumed.advance(3)
    assert resumed.state_dict()["samples"] == 320 + 3 * 4


def test_the_tensor_encoding_is_the_list_encoding():
    """``encode_tensor`` (every rank's start-up: the whole corpus at once) gives ``encode``'s ids, on the corpus
    and on text beyond ASCII, and refuses a character outside the vocabulary in the same words."""
    corpus = data.load_corpus("tinyshakespeare", announce=lambda _: None).text
    for text in (corpus, "naïve café — ünïcödé 🙂\n"):
        tok = data.CharTokenizer.from_text(text)
        ids = tok.encode_tensor(text)
        assert ids.dtype == torch.long and torch.equal(ids, torch.tensor(tok.encode(text), dtype=torch.long))
    assert tok.encode_tensor("").shape == (0,)
    for outside in ("🚀", "\x00", "x"):  # beyond the last, before the first, and between characters of the table
        with pytest.raises(ValueError) as listed:
            tok.encode(outside)
        with pytest.raises(ValueError) as vectorised:
            tok.encode_tensor("é" + outside)
        assert str(vectorised.value) == str(listed.value)
