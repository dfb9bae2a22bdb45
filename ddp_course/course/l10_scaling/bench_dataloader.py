"""DataLoader tuning, measured: worker processes, prefetching, persistent workers, pinned memory.

    python -m ddp_course.bench dataloader
    python -m ddp_course.course.l10_scaling.bench_dataloader --batches=30 --repeats=4 --out=/tmp/bench

One process plays one rank of a training job: it takes batches from a ``torch.utils.data.DataLoader``
and, for each, runs a forward and backward of MiniGPT (``--consumer=train``; ``none`` times the
loader alone) on ``--device`` (``auto``, the default: the first GPU if there is one, else the CPU; a
step on a GPU leaves the CPU's cores to the workers, which is where the two differ). The dataset tokenizes its windows of Tiny Shakespeare *when they are read*, each window
``--repeats`` times: real CPU work in Python per sample, standing in for the decoding and augmentation a
real input pipeline does. Every configuration reads the same batches.

Measured, each over ``--batches`` batches (after the first, whose latency is reported on its own):

- ``num_workers`` 0, 1, 2: with 0 the training process prepares every batch itself, between steps;
  with workers, other processes prepare the next batches while it computes. ``wait`` is the time the
  training loop spends in ``next(loader)``: what the accelerator would sit idle for.
- ``prefetch_factor`` (batches queued per worker, default 2): a deeper queue absorbs uneven batch
  times; it cannot make a pipeline faster than its workers.
- ``persistent_workers``: without it, every epoch starts (forks) its workers again and waits for
  their first batches; with it, the workers live across epochs. Measured over ``--epochs`` short
  epochs of ``--epoch_batches`` batches.
- ``pin_memory``: page-locked host memory lets a CUDA copy run asynchronously (``non_blocking=True``)
  and faster. It only means something when batches are copied to a CUDA GPU; without one the bench
  says so and measures nothing for it.

Each process uses ``--threads`` torch threads (default 1, like a rank). On a machine with fewer cores
than the training process plus its workers, the workers compete with training for the cores; the
bench prints the core count so the result can be read against it. Prints a table and writes
``<out>/dataloader.json`` (``--out`` defaults to ``bench_results``).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ddp_course import bench as harness
from ddp_course.bench import BenchError as BenchError  # re-exported: callers catch module.BenchError
from ddp_course.bench import OptionError

NAME = "dataloader"

class TokenizeOnRead(Dataset):
    """Windows of raw text, tokenized when read: ``repeats`` passes of the character tokenizer.

    Item i is the window starting at character ``i * block_size``; it returns (x, y) like the
    course's ``TokenWindows``. Only the first pass is kept; the others are the per-sample work.
    """

    def __init__(self, text: str, stoi: dict[str, int], block_size: int, repeats: int):
        self.text, self.stoi, self.block_size, self.repeats = text, stoi, block_size, repeats

    def __len__(self) -> int:
        return (len(self.text) - self.block_size - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.text[i * self.block_size: i * self.block_size + self.block_size + 1]
        ids = [self.stoi[c] for c in chunk]
        for _ in range(self.repeats - 1):
            ids2 = [self.stoi[c] for c in chunk]
            assert ids2 == ids
        t = torch.tensor(ids, dtype=torch.long)
        return t[:-1], t[1:]


def _check(opts: dict[str, Any]) -> None:
    """Refuse options that cannot give a measurement; ``workers`` and ``prefetch`` become lists."""
    for key in ("workers", "prefetch"):
        opts[key] = harness.int_list(opts, key, "0,1,2")
    if not opts["workers"] or min(opts["workers"]) < 0:
        raise OptionError(f"--workers must list counts of 0 or more (got {opts['workers']}).")
    if not opts["prefetch"] or min(opts["prefetch"]) < 1:
        raise OptionError(f"--prefetch must list factors of at least 1 (got {opts['prefetch']}).")
    harness.positive(opts, "batches", "rounds", "batch_size", "block_size", "repeats", "epochs", "epoch_batches",
                     "threads")
    harness.choice(opts, "device", ("auto", "cpu", "cuda"))
    harness.choice(opts, "consumer", ("train", "none"))


def measure(loader_kwargs: dict[str, Any], ds: Dataset, order: list[int], opts: dict[str, Any], step, n_batches: int,
            epochs: int = 1) -> dict[str, Any]:
    """Iterate ``epochs`` epochs of ``n_batches`` (+1) batches; time waiting for data and computing."""
    loader = DataLoader(ds, batch_size=opts["batch_size"], sampler=order[: (n_batches + 1) * opts["batch_size"]],
                        drop_last=True, **loader_kwargs)
    first, waits, computes, epoch_s = [], [], [], []
    for _ in range(epochs):
        t_epoch = time.perf_counter()
        it = iter(loader)  # without persistent workers, this starts the worker processes
        for b in range(n_batches + 1):
            t0 = time.perf_counter()
            x, y = next(it)
            t1 = time.perf_counter()
            step(x, y)
            t2 = time.perf_counter()
            if b == 0:
                first.append(t1 - t_epoch)  # from iter() to the first batch: start-up and the first batch
            else:
                waits.append(t1 - t0)
                computes.append(t2 - t1)
        del it
        epoch_s.append(time.perf_counter() - t_epoch)
    return {"first_batch_s": statistics.median(first), "wait_per_batch_s": statistics.mean(waits),
            "compute_per_batch_s": statistics.mean(computes),
            "per_batch_s": (sum(waits) + sum(computes)) / len(waits), "epoch_s": epoch_s,
            "first_batch_each_epoch_s": first}


@harness.bench(NAME, check=_check,
               batches=(8, "timed batches per configuration and round (after the first)"),
               rounds=(3, "rounds; each measures every configuration, in a rotated order; medians are reported"),
               batch_size=(8, "sequences per batch"), block_size=(64, "tokens per sequence"),
               repeats=(300, "times each window is tokenized when read (the per-sample CPU work)"),
               consumer=("train", "train (forward+backward of MiniGPT per batch) | none (the loader alone)"),
               n_layer=(2, "consumer model: blocks"), n_head=(4, "consumer model: heads"),
               n_embd=(64, "consumer model: width"),
               workers=("0,1,2", "num_workers values to compare (comma-separated)"),
               prefetch=("2,4", "prefetch_factor values to compare with the most workers (comma-separated)"),
               epochs=(3, "short epochs for the persistent_workers comparison"),
               epoch_batches=(4, "batches per short epoch"),
               threads=(1, "torch threads of the training process (workers use 1)"),
               device=("auto", "auto (the first GPU, else CPU) | cpu | cuda: where the consumer's forward and "
                               "backward run"),
               corpus=("tinyshakespeare", "tinyshakespeare | offline | a path"),
               seed=(0, "sample order"))
def run_bench(opts: dict[str, Any]) -> dict[str, Any]:
    """Time every DataLoader configuration; returns the result written to ``<out>/dataloader.json``."""
    from ddp_course.data import CharTokenizer, load_corpus
    from ddp_course.dist import cpu_count
    from ddp_course.model import GPTConfig, MiniGPT

    device_type, _, reason = harness.device_for(opts["device"], 1)  # one process: the first GPU, if any
    device = torch.device("cuda", torch.cuda.current_device()) if device_type.type == "cuda" else torch.device("cpu")
    reason = reason.replace(" with gloo", "").replace(" with NCCL", "")  # one process: no backend
    torch.set_num_threads(opts["threads"])
    corpus = load_corpus(opts["corpus"], announce=print)
    tok = CharTokenizer.from_text(corpus.text)
    ds = TokenizeOnRead(corpus.text, tok.stoi, opts["block_size"], opts["repeats"])
    g = torch.Generator().manual_seed(opts["seed"])
    order = torch.randperm(len(ds), generator=g).tolist()
    cores = cpu_count()

    t0 = time.perf_counter()
    for i in order[:64]:
        ds[i]
    sample_s = (time.perf_counter() - t0) / 64

    if opts["consumer"] == "train":
        torch.manual_seed(opts["seed"])
        model = MiniGPT(GPTConfig(vocab_size=tok.vocab_size, block_size=opts["block_size"], n_layer=opts["n_layer"],
                                  n_head=opts["n_head"], n_embd=opts["n_embd"])).to(device)

        def step(x, y):
            _, loss = model(x.to(device), y.to(device))
            loss.backward()
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the step's time is its kernels', not their queueing
        for _ in range(3):  # warm-up: allocations, first kernels
            step(*next(iter(DataLoader(ds, batch_size=opts["batch_size"], sampler=order[:opts["batch_size"]]))))
    else:
        def step(x, y):
            pass

    print(f"[dataloader] {cores} core(s) visible; one sample costs {sample_s * 1e3:.2f} ms to read "
          f"({opts['repeats']} tokenizer passes over {opts['block_size'] + 1} characters), a batch of "
          f"{opts['batch_size']} {opts['batch_size'] * sample_s * 1e3:.1f} ms; consumer: {opts['consumer']}"
          + (f" on {reason}" if opts["consumer"] == "train" else ""), flush=True)

    configs: list[tuple[str, str, dict[str, Any]]] = [(f"num_workers={w}", "workers", {"num_workers": w})
                                                      for w in opts["workers"]]
    w_max = max(opts["workers"])
    if w_max > 0:
        configs += [(f"num_workers={w_max}, prefetch_factor={pf}", "prefetch", {"num_workers": w_max, "prefetch_factor": pf})
                    for pf in opts["prefetch"] if pf != 2]  # 2 is the default, measured above
    per_round: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in configs}
    for r in range(opts["rounds"]):  # rotate the order: load that comes and goes hits every configuration
        for label, _, kwargs in configs[r % len(configs):] + configs[: r % len(configs)]:
            per_round[label].append(measure(kwargs, ds, order, opts, step, opts["batches"]))
    rows = []
    for label, kind, kwargs in configs:
        rs = per_round[label]
        med = {k: statistics.median(x[k] for x in rs) for k in ("first_batch_s", "wait_per_batch_s",
                                                                   "compute_per_batch_s", "per_batch_s")}
        rows.append({"label": label, "kind": kind, **kwargs, **med, "rounds": rs})
        print(f"[dataloader] {label:<34} wait {med['wait_per_batch_s'] * 1e3:7.2f} ms/batch, compute "
              f"{med['compute_per_batch_s'] * 1e3:7.2f} ms/batch, first batch {med['first_batch_s'] * 1e3:7.1f} ms "
              f"(medians of {len(rs)} rounds)", flush=True)

    persistent = []
    if w_max > 0:
        for keep in (False, True):
            res = measure({"num_workers": w_max, "persistent_workers": keep}, ds, order, opts, step,
                          opts["epoch_batches"], epochs=opts["epochs"])
            persistent.append({"persistent_workers": keep, "num_workers": w_max, **res})
            print(f"[dataloader] num_workers={w_max}, persistent_workers={keep!s:<5} first batch of each epoch: "
                  + ", ".join(f"{s * 1e3:.0f}" for s in res["first_batch_each_epoch_s"]) + " ms", flush=True)

    if torch.cuda.is_available():
        pin = []
        x = torch.randint(0, tok.vocab_size, (opts["batch_size"], opts["block_size"]))
        for pinned in (False, True):
            src = x.pin_memory() if pinned else x
            times = []
            for _ in range(50):
                torch.cuda.synchronize()
                t = time.perf_counter()
                src.to("cuda", non_blocking=pinned)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t)
            pin.append({"pinned": pinned, "copy_s": statistics.median(times[5:])})
        pin_memory = {"measured": True, "rows": pin, "device": torch.cuda.get_device_name(0)}
    else:
        pin_memory = {"measured": False,
                      "reason": "no CUDA GPU: pin_memory only speeds up host-to-GPU copies, so there is nothing "
                                "to measure on this machine (DataLoader(pin_memory=True) without a GPU does nothing "
                                "but warn)"}
    print(f"[dataloader] pin_memory: {'measured' if pin_memory['measured'] else pin_memory['reason']}")

    base = rows[0]
    print()
    print(f"{'configuration':<36} {'wait ms':>8} {'compute ms':>10} {'ms/batch':>9} {'speedup':>8}")
    for r in rows:
        r["speedup_vs_0_workers"] = base["per_batch_s"] / r["per_batch_s"]
        print(f"{r['label']:<36} {r['wait_per_batch_s'] * 1e3:>8.2f} {r['compute_per_batch_s'] * 1e3:>10.2f} "
              f"{r['per_batch_s'] * 1e3:>9.2f} {r['speedup_vs_0_workers']:>8.2f}")
    return {"bench": NAME, "options": opts, "device": device.type, "device_reason": reason,
            "cpu_count": cores, "sample_s": sample_s,
            "batch_read_s": sample_s * opts["batch_size"], "rows": rows, "persistent": persistent,
            "pin_memory": pin_memory}


bench, main = harness.entry_points(NAME)


if __name__ == "__main__":
    sys.exit(main())
