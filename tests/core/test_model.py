"""MiniGPT on its own: shapes, initial loss, tying, counts, causality, checkpointing, sampling."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ddp_course.model import Block, GPTConfig, MiniGPT

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32)


def _model(cfg: GPTConfig = CFG, seed: int = 0) -> MiniGPT:
    torch.manual_seed(seed)
    return MiniGPT(cfg)


def _batch(cfg: GPTConfig = CFG, B: int = 4, T: int | None = None, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    T = T or cfg.block_size
    x = torch.randint(cfg.vocab_size, (B, T), generator=g)
    y = torch.randint(cfg.vocab_size, (B, T), generator=g)
    return x, y


def test_logits_shape_and_scalar_loss():
    m = _model()
    x, y = _batch(B=3, T=10)  # shorter than block_size is fine
    logits = m(x)
    assert logits.shape == (3, 10, CFG.vocab_size)
    logits2, loss = m(x, y)
    assert torch.equal(logits, logits2)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert torch.isfinite(loss)


@pytest.mark.parametrize("n_embd", [32, 128])
def test_initial_loss_is_near_ln_vocab(n_embd):
    # At init the logits are ln_f(x) (unit variance per channel) times a head with std 0.02, so each
    # logit has std sigma = 0.02 * sqrt(C) (0.11 for C=32, 0.23 for C=128) and the expected loss is
    # about ln(V) + sigma^2 / 2 (<= 0.03 above ln V). A tolerance of 0.1 covers that plus batch
    # noise; a wrongly scaled init (std 1, say) starts several nats above ln(V).
    cfg = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=n_embd)
    m = _model(cfg)
    x, y = _batch(cfg, B=16)
    _, loss = m(x, y)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1


def test_weight_tying():
    m = _model()
    assert m.head.weight is m.tok_emb.weight
    names = [n for n, _ in m.named_parameters()]
    assert "tok_emb.weight" in names and "head.weight" not in names  # one parameter, listed once
    # a gradient step on the shared matrix moves both the embedding and the un-embedding
    x, y = _batch()
    m(x, y)[1].backward()
    assert m.tok_emb.weight.grad is not None and m.head.weight.grad is m.tok_emb.weight.grad


def test_num_params_counts_the_tied_matrix_once():
    m = _model()
    V, C, T = CFG.vocab_size, CFG.n_embd, CFG.block_size
    state_total = sum(t.numel() for t in m.state_dict().values())  # the state dict lists both names
    assert m.num_params() == state_total - V * C
    assert m.num_params(include_embeddings=False) == m.num_params() - T * C


def test_num_params_and_flops_per_token_from_the_architecture():
    for cfg in (CFG, GPTConfig(vocab_size=80, block_size=32, n_layer=3, n_head=4, n_embd=64)):
        m = _model(cfg)
        V, T, L, C = cfg.vocab_size, cfg.block_size, cfg.n_layer, cfg.n_embd
        per_block = (2 * C  # ln1
                     + C * 3 * C + 3 * C  # qkv
                     + C * C + C  # attention projection
                     + 2 * C  # ln2
                     + C * 4 * C + 4 * C  # mlp fc
                     + 4 * C * C + C)  # mlp projection
        non_pos = V * C + L * per_block + 2 * C  # tied embedding/head, blocks, ln_f
        assert m.num_params() == non_pos + T * C
        assert m.flops_per_token() == 6 * non_pos + 12 * L * T * C


def test_sequence_longer_than_block_size_raises():
    m = _model()
    x, _ = _batch(T=CFG.block_size)
    m(x)  # exactly block_size is fine
    x = torch.zeros(1, CFG.block_size + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="block_size"):
        m(x)


def test_causality_future_tokens_do_not_change_earlier_logits():
    m = _model().eval()
    x, _ = _batch(B=2)
    t = 9
    x2 = x.clone()
    x2[:, t] = (x2[:, t] + 1) % CFG.vocab_size
    with torch.no_grad():
        a, b = m(x), m(x2)
    # The masked positions get exactly zero attention weight, so positions < t compute the same
    # numbers from the same inputs; 1e-6 only allows for a kernel that blocks rows differently.
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=1e-6)
    assert (a[:, t:] - b[:, t:]).abs().amax() > 1e-4  # and the change is visible from position t on


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    plain = _model()
    ckpt = MiniGPT(GPTConfig(**{**CFG.__dict__, "activation_checkpointing": True}))
    ckpt.load_state_dict(plain.state_dict())
    calls = {"plain": 0, "ckpt": 0}

    def counting(block: Block, name: str):
        def forward(x):  # module hooks do not fire on recomputation, so wrap forward itself
            calls[name] += 1
            return Block.forward(block, x)
        return forward

    for name, model in (("plain", plain), ("ckpt", ckpt)):
        for mod in model.modules():
            if isinstance(mod, Block):
                mod.forward = counting(mod, name)
    x, y = _batch()
    losses = []
    for model in (plain, ckpt):
        model.train()
        _, loss = model(x, y)
        loss.backward()
        losses.append(loss)
    # The recomputation runs the same ops on the same inputs, so results should be bit-identical on
    # CPU; the tolerance (1e-6 relative) only allows a different kernel choice on recompute.
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0)
    for (n, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-9, msg=lambda m, n=n: f"{n}: {m}")
    # checkpointing really happened: every block ran twice (forward, then recompute in backward)
    assert calls == {"plain": CFG.n_layer, "ckpt": 2 * CFG.n_layer}


def test_generate_length_determinism_and_mode():
    m = _model()
    m.train()
    start = torch.zeros(2, 3, dtype=torch.long)
    n_new = CFG.block_size + 5  # longer than the context: generation crops to the last block_size
    out1 = m.generate(start, n_new, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(42))
    out2 = m.generate(start, n_new, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(42))
    out3 = m.generate(start, n_new, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(43))
    assert out1.shape == (2, 3 + n_new)
    assert torch.equal(out1[:, :3], start)
    assert torch.equal(out1, out2)
    assert not torch.equal(out1, out3)
    assert int(out1.min()) >= 0 and int(out1.max()) < CFG.vocab_size
    assert m.training  # generate() restores the mode it found


def test_generate_top_k_1_is_greedy():
    m = _model()
    start = torch.tensor([[1, 2, 3]])
    out = m.generate(start, 4, top_k=1, generator=torch.Generator().manual_seed(0))
    idx = start
    with torch.no_grad():
        for _ in range(4):
            idx = torch.cat([idx, m(idx)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, idx)


def test_the_shape_a_checkpoint_records_is_every_field_but_the_training_switches():
    """GPTConfig.shape (what a checkpoint records and a resume compares) is every field of GPTConfig but
    dropout and activation checkpointing, which change no weight: a checkpoint resumes across them."""
    base = GPTConfig(vocab_size=65, block_size=16, n_layer=1, n_head=2, n_embd=32)
    switches = {"dropout": 0.5, "activation_checkpointing": True}
    assert set(base.shape()) == {f.name for f in dataclasses.fields(GPTConfig)} - set(switches)
    assert base.shape() == {"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 32, "vocab_size": 65}

    def shapes(cfg: GPTConfig) -> dict:
        return {k: v.shape for k, v in MiniGPT(cfg).state_dict().items()}

    assert all(shapes(dataclasses.replace(base, **{k: v})) == shapes(base) for k, v in switches.items())
