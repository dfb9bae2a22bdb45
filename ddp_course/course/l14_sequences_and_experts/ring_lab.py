"""Ring attention on CPU ranks, against one process: parity, work, bytes, memory, and training.

    torchrun --standalone --nproc_per_node=4 -m ddp_course.course.l14_sequences_and_experts.ring_lab --out_dir=runs/14_ring

Every rank draws the same whole-sequence q, k, v (seeded) and keeps its chunks (``ring.layout``). The
lab measures, for both layouts (``plain``, ``zigzag``):

- **parity** with one process's ``scaled_dot_product_attention(is_causal=True)``: the output and the
  gradients of q, k and v, in float32 and float64, on rings of 2 ranks (the world split in pairs) and
  of all the ranks;
- **work per rank**: score blocks and entries computed (against ``ring.predicted_work``) and the CPU
  seconds spent computing them, median of ``--repeats`` forward-and-backward passes of a longer sequence;
- **bytes sent per rank**, forward and backward, against ``ring.predicted_bytes``;
- **memory**: the peak bytes of the tensors a rank's forward and backward create (:class:`PeakBytes`),
  against one process attending over the whole sequence, with the score matrix written out and with
  PyTorch's fused kernel;
- **training**: MiniGPT with every block's attention on a ring of 2 (``context_parallel``), ``--steps``
  AdamW steps on the corpus, each step's loss against one process trained on the same batches; in
  float32 on ranks 0 and 1 and, at the same time on 4 ranks, in float64 on ranks 2 and 3 (one after the
  other on 2 ranks), then the two one-process references on other ranks while rank 0 measures one
  process's memory.

Rank 0 writes ``ring_lab.json``.
"""

from __future__ import annotations

import statistics
import sys
import time
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ddp_course.cli import FlagError, command, parse_flags
from ddp_course.course.l11_beyond_data_parallel.tp_lab import same_batches  # --steps batches of the corpus
from ddp_course.course.l14_sequences_and_experts import context_parallel as cp
from ddp_course.course.l14_sequences_and_experts import ring as R
from ddp_course.course.options import lab_help, write_result
from ddp_course.dist import log, seeded, setup
from ddp_course.model import GPTConfig, MiniGPT

PROG = "torchrun --standalone --nproc_per_node=4 -m ddp_course.course.l14_sequences_and_experts.ring_lab"
DEFAULTS: dict[str, Any] = {
    "out_dir": "runs/14_ring", "parity_seq": 64, "seq": 4096, "heads": 4, "head_dim": 32, "repeats": 3,
    "steps": 100, "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 64, "batch_size": 8, "lr": 3e-3,
    "seed": 0, "corpus": "tinyshakespeare", "timeout_s": 60.0,
}
HELP = lab_help("ring_lab", DEFAULTS, parity_seq="tokens of the parity check's sequence",
                seq="tokens of the sequence whose work, bytes and memory are measured", heads="attention heads",
                head_dim="size of one head", repeats="forward-and-backward passes timed per layout",
                steps="AdamW steps of MiniGPT on the ring and of the one-process reference", n_head="MiniGPT's heads",
                n_embd="MiniGPT's width", block_size="MiniGPT's sequence length",
                batch_size="sequences per step (every rank reads the same ones, its chunks of them)",
                seed="tensors, weights and batches")
# Parity bound, float32: ||ring - one process|| / ||one process||. Both compute the same sums in other
# orders (blocks merged through the log-sum-exp against PyTorch's kernel), so they differ by rounding:
# float32's unit roundoff is 6e-8, and the float64 run of the same code (~1e-15) shows that nothing
# but rounding is left. 1e-6 is ~16 units of roundoff.
PARITY_RTOL = 1e-6


class PeakBytes(TorchDispatchMode):
    """The peak of the bytes held by storages created while the mode is active (views and in-place
    results are not new memory): what a computation allocates on top of its inputs.

    A storage counts from the op that creates it until the storage itself is freed, however many tensors
    share it: autograd saves an op's output as a tensor of its own on the same storage, so a tensor's
    death would say nothing. PyTorch keeps one Python object per storage for as long as the storage
    lives, so a finalizer on that object fires when the memory goes (:func:`check_peak_bytes` shows it)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # id of a live storage -> its bytes
        self.now = self.peak = 0

    def _release(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.is_mutable:
            return out
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel():
                storage = t.untyped_storage()
                if id(storage) not in self.live:
                    self.live[id(storage)] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._release, id(storage))
        return out


def check_peak_bytes() -> dict[str, int]:
    """What :class:`PeakBytes` reads for cases counted by hand: a 4 MB result kept for backward (autograd
    saves exp's output), then freed with the graph; two results alive at once; one result of two views."""
    x = torch.randn(1000, 1000, requires_grad=True)
    with PeakBytes() as saved:
        y = torch.exp(x).sum()  # exp's 4 MB output lives on inside the graph
        held = saved.now
        del y  # the graph goes, and with it the saved output
    with PeakBytes() as two:
        a, b = x.detach() * 2, x.detach() * 3
        del a, b
    with PeakBytes() as views:
        c = x.detach() + 1
        c.view(-1)[:10].t()
        del c
    return {"saved_output_held": held, "after_the_graph_is_gone": saved.now, "two_alive": two.peak,
            "one_with_views": views.peak, "one_result": 4 * 1000 * 1000}


def _qkv(seq: int, heads: int, head_dim: int, seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, seq, head_dim, generator=g, dtype=dtype) for _ in range(4)]  # q, k, v, dout


def parity(ring: R.Ring, seq: int, heads: int, head_dim: int, seed: int, dtype: torch.dtype) -> dict[str, float]:
    """Relative errors of this rank's out, dq, dk, dv against one process's, on the same tensors."""
    q, k, v, dout = _qkv(seq, heads, head_dim, seed, dtype)
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*whole, is_causal=True)
    ref.backward(dout)
    mine = [R.shard(t, ring.kind, ring.size, ring.rank).requires_grad_() for t in (q, k, v)]
    out = R.ring_attention(*mine, ring)
    out.backward(R.shard(dout, ring.kind, ring.size, ring.rank))
    part = lambda t: R.shard(t, ring.kind, ring.size, ring.rank)  # noqa: E731
    return {"out": R.relative_error(out, part(ref)), **{f"d{n}": R.relative_error(m.grad, part(w.grad)) for n, m, w in zip("qkv", mine, whole)}}


def work_and_bytes(ring: R.Ring, opts: dict[str, Any]) -> dict[str, Any]:
    """Blocks, score entries, CPU seconds (each timed pass; one untimed pass first), bytes and peak memory
    of one rank."""
    q, k, v, dout = _qkv(opts["seq"], opts["heads"], opts["head_dim"], opts["seed"], torch.float32)
    mine = [R.shard(t, ring.kind, ring.size, ring.rank) for t in (q, k, v)]
    passes = []
    for n in range(opts["repeats"] + 1):  # the first pass warms up (buffers, connections) and is not kept
        ring.reset()
        leaves = [t.clone().requires_grad_() for t in mine]
        dist.barrier(group=ring.group)
        t0 = time.perf_counter()
        with PeakBytes() as peak:
            R.ring_attention(*leaves, ring).backward(R.shard(dout, ring.kind, ring.size, ring.rank))
        if n:
            passes.append({"wall_s": time.perf_counter() - t0, "compute_s": ring.compute_s,
                           "block_s": dict(ring.block_s), "peak_bytes": peak.peak})
    kv_bytes = 2 * mine[1].numel() * mine[1].element_size()
    return {"blocks": ring.blocks, "score_elements": ring.score_elements, "block_count": dict(ring.block_count),
            "compute_s": statistics.median(x["compute_s"] for x in passes),
            "compute_s_all": [x["compute_s"] for x in passes], "wall_s_all": [x["wall_s"] for x in passes],
            "block_s_all": [x["block_s"] for x in passes], "bytes_sent": dict(ring.bytes_sent),
            "predicted_bytes": R.predicted_bytes(ring.size, kv_bytes), "peak_bytes": max(x["peak_bytes"] for x in passes),
            "max_block_elements": ring.max_block_elements, "block_bytes": ring.max_block_elements * q.element_size()}


def one_process_memory(opts: dict[str, Any]) -> dict[str, int]:
    """Peak bytes of one process's forward and backward over the whole sequence: the scores written
    out (softmax(q k^T) v, causal) and PyTorch's fused kernel."""
    q, k, v, dout = _qkv(opts["seq"], opts["heads"], opts["head_dim"], opts["seed"], torch.float32)
    seq = q.shape[-2]

    def written_out(q, k, v):
        s = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
        s = s.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    out: dict[str, int] = {"score_matrix_bytes": q.shape[1] * seq * seq * q.element_size()}
    for name, fn in (("written_out", written_out),
                     ("fused", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with PeakBytes() as peak:
            fn(*leaves).backward(dout)
        out[name] = peak.peak
    return out


def train_on_ring(ring: R.Ring, opts: dict[str, Any], batches: list, vocab: int, dtype: torch.dtype
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """MiniGPT with its attention on the ring: each step's loss (the sum of the ranks' shares), and the
    first step's gradients (summed over the ranks: every rank holds them whole)."""
    model = cp.context_parallel(build(opts, vocab).to(dtype), ring)
    opt = torch.optim.AdamW(model.parameters(), lr=opts["lr"])
    losses, first = [], {}
    for x, y in batches:
        loss = cp.local_loss(model, x, y, ring)
        loss.backward()
        cp.sum_gradients(model, ring.group)
        first = first or {n: w.grad.detach().clone() for n, w in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total, group=ring.group)
        losses.append(float(total))
    return losses, first


def train_one_process(opts: dict[str, Any], batches: list, vocab: int, dtype: torch.dtype
                      ) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = build(opts, vocab).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=opts["lr"])
    losses, first = [], {}
    for x, y in batches:
        logits = model(x)  # the loss in the model's own precision (MiniGPT's own takes it in float32)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        first = first or {n: w.grad.detach().clone() for n, w in model.named_parameters()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses, first


def build(opts: dict[str, Any], vocab: int) -> MiniGPT:
    with seeded(opts["seed"]):
        return MiniGPT(GPTConfig(vocab_size=vocab, **{k: opts[k] for k in ("block_size", "n_layer", "n_head", "n_embd")}))


def check_options(opts: dict[str, Any], world_size: int) -> None:
    if world_size not in (2, 4):
        raise FlagError(f"the lab runs on 2 or 4 ranks (got {world_size}): launch it with `{PROG}`.")
    for key in ("parity_seq", "seq", "block_size"):
        if opts[key] % (2 * world_size):
            raise FlagError(f"--{key}={opts[key]} must be divisible by {2 * world_size} (the zigzag layout's "
                            f"2 x {world_size} chunks).")
    if opts["n_embd"] % opts["n_head"]:
        raise FlagError(f"--n_embd={opts['n_embd']} must be divisible by --n_head={opts['n_head']}.")


def gather(value: Any, world_size: int) -> list:
    every: list = [None] * world_size
    dist.all_gather_object(every, value)
    return every


@command
def main(argv: list[str]) -> int:
    import os

    opts = parse_flags(argv, DEFAULTS, PROG, doc=__doc__, helps=HELP)
    check_options(opts, int(os.environ.get("WORLD_SIZE", 1)))
    with setup(device="cpu", timeout_s=opts["timeout_s"], threads=1,
               because="ring attention by hand runs on gloo's point-to-point sends; the same code runs on NCCL"
               ) as info:
        if not info.is_distributed:
            raise FlagError(f"the lab needs a process group: launch it with `{PROG}`.")
        n, t0 = info.world_size, time.perf_counter()
        pairs = [dist.new_group([r, r + 1]) for r in range(0, n, 2)] if n > 2 else [None]
        rings = {2: pairs[info.rank // 2], n: None}
        results: dict[str, Any] = {"world_size": n, "options": opts, "parity_rtol": PARITY_RTOL, "parity": {},
                                   "layouts": {}}
        for size, group in rings.items():
            for kind in R.LAYOUTS:
                for dtype in (torch.float32, torch.float64):
                    errs = parity(R.Ring(kind, group), opts["parity_seq"], opts["heads"], opts["head_dim"],
                                  opts["seed"], dtype)
                    worst = {k: max(e[k] for e in gather(errs, n)) for k in errs}
                    results["parity"][f"{size}/{kind}/{str(dtype)[6:]}"] = worst
                    log(f"[ring_lab] parity, ring of {size}, {kind:<6} {str(dtype)[6:]}: "
                        + ", ".join(f"{k} {e:.1e}" for k, e in worst.items()))
        for kind in R.LAYOUTS:
            mine = work_and_bytes(R.Ring(kind), opts)
            per_rank = gather(mine, n)
            results["layouts"][kind] = {"per_rank": per_rank, "predicted": R.predicted_work(kind, n, opts["seq"])}
            log(f"[ring_lab] {kind:<6} blocks per rank {[r['blocks'] for r in per_rank]}, CPU ms per rank "
                f"{[round(1e3 * r['compute_s'], 1) for r in per_rank]}, sent per rank "
                f"{[sum(r['bytes_sent'].values()) for r in per_rank]} bytes")
        batches, vocab = same_batches(opts, info.device)
        # MiniGPT trains on rings of 2: in float32 on ranks 0 and 1 and, on 4 ranks, in float64 on ranks 2
        # and 3 at the same time (on 2 ranks, after the float32 run). Then the one-process references, on
        # the last rank (float32) and on rank 1 (float64), while rank 0 measures one process's memory.
        dtypes = {"float32": torch.float32, "float64": torch.float64}
        ring_of = {"float32": 0, "float64": 1 % len(pairs)}  # which pair trains each precision
        reference_rank = {"float32": n - 1, "float64": 1}
        share: dict[str, Any] = {"ring": {}, "reference": {}}  # what this rank trained
        for name, dtype in dtypes.items():
            members = [2 * ring_of[name], 2 * ring_of[name] + 1]
            if info.rank in members:
                run = train_on_ring(R.Ring("zigzag", pairs[ring_of[name]]), opts, batches, vocab, dtype)
                if info.rank == members[0]:
                    share["ring"][name] = (run, members)
        for name, dtype in dtypes.items():
            if info.rank == reference_rank[name]:
                share["reference"][name] = train_one_process(opts, batches, vocab, dtype)
        if info.is_main:
            results["one_process_memory"] = one_process_memory(opts)
            results["peak_check"] = check_peak_bytes()
        every = gather(share, n)
        results["training"] = {}
        for name in dtypes:
            (ring_l, ring_g), members = next(r["ring"][name] for r in every if name in r["ring"])
            ref_l, ref_g = every[reference_rank[name]]["reference"][name]
            diff = [abs(a - b) / abs(b) for a, b in zip(ring_l, ref_l)]
            grads = {n: R.relative_error(ring_g[n], ref_g[n]) for n in ref_g}  # the tied head's gradient is the table's
            results["training"][name] = {"ring_ranks": 2, "ring_on": members, "reference_rank": reference_rank[name],
                                         "ring_losses": ring_l, "reference_losses": ref_l,
                                         "loss_rel_diff": diff, "first_grad_rel_err": grads}
            log(f"[ring_lab] MiniGPT on a ring of 2 (ranks {members}), {name}, {len(ring_l)} steps: loss "
                f"{ring_l[0]:.4f} -> {ring_l[-1]:.4f}; largest relative difference from one process {max(diff):.1e}; "
                f"first step's gradients {max(grads.values()):.1e} (worst of {len(grads)} parameters)")
        results["seconds"] = time.perf_counter() - t0
        write_result(info, opts["out_dir"], "ring_lab", results, f" ({results['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
