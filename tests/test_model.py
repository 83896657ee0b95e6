"""model.GPT on tiny configs: shapes, causality, reference attention, optimizer groups, FLOPs, sampling.
(GPT-2's init and tied embeddings, weight for weight: tests/test_llama.py::test_gpt2_default_is_unchanged.)"""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY

from model import GPT, CausalSelfAttention, GPTConfig


def tiny_model(seed=0, **overrides):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**TINY, **overrides}))
    return model.eval()


def random_idx(B, T, vocab_size=65, seed=1):
    return torch.randint(0, vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- shapes and vocabulary


def test_output_shapes():
    model = tiny_model()
    B, T, V = 3, 16, 65
    idx, targets = random_idx(B, T), random_idx(B, T, seed=2)
    logits, loss = model(idx, targets)
    assert logits.shape == (B, T, V)  # the real vocabulary, not the padded one
    assert loss.dim() == 0 and torch.isfinite(loss)
    logits, loss = model(idx)
    assert logits.shape == (B, 1, V) and loss is None
    all_logits, _ = model(idx, logits_at="all")
    assert all_logits.shape == (B, T, V)
    # the last-position shortcut is the last row of the full computation
    torch.testing.assert_close(logits[:, 0], all_logits[:, -1])


def test_sequence_longer_than_block_size_is_rejected():
    with pytest.raises(ValueError, match="block_size"):
        tiny_model()(random_idx(1, 17))


@pytest.mark.parametrize("vocab_size", [1, 63, 64, 65, 50257])
def test_padded_vocab_size(vocab_size):
    padded = GPTConfig(vocab_size=vocab_size).padded_vocab_size
    assert padded % 64 == 0 and vocab_size <= padded < vocab_size + 64


def test_generate_never_emits_padding_ids():
    model = tiny_model(vocab_size=65)
    assert model.config.padded_vocab_size == 128  # 63 padding rows a buggy sampler could pick
    # large random weights and a high temperature make the distribution close to uniform over
    # whatever rows the sampler sees, so padding ids would show up if they were reachable
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 1.0)
    torch.manual_seed(0)
    out = model.generate(torch.zeros(8, 1, dtype=torch.long), max_new_tokens=64, temperature=10.0)
    assert out.shape == (8, 65)
    assert int(out.max()) < 65 and int(out.min()) >= 0
    assert len(torch.unique(out)) > 40  # really sampled widely


# ---------------------------------------------------------------------------- causality and the loss at init


def test_causality():
    model = tiny_model()
    idx = random_idx(2, 16)
    base, _ = model(idx, logits_at="all")
    t = 9
    changed_idx = idx.clone()
    changed_idx[:, t] = (changed_idx[:, t] + 1) % 65
    changed, _ = model(changed_idx, logits_at="all")
    assert torch.equal(changed[:, :t], base[:, :t])  # exactly: the past never sees the future
    assert not torch.allclose(changed[:, t:], base[:, t:])
    # every later position is affected, not only position t
    assert all(not torch.allclose(changed[:, s], base[:, s]) for s in range(t, 16))


def test_initial_loss_is_about_log_vocab_size():
    model = tiny_model()
    idx, targets = random_idx(16, 16), random_idx(16, 16, seed=3)
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(65)) < 0.15


def test_loss_is_mean_cross_entropy_and_ignores_minus_one():
    model = tiny_model()
    idx, targets = random_idx(2, 8), random_idx(2, 8, seed=3)
    targets[0, :3] = -1
    logits, loss = model(idx, targets)
    keep = targets != -1
    expected = -torch.log_softmax(logits, -1)[keep].gather(-1, targets[keep][:, None]).mean()
    torch.testing.assert_close(loss, expected)


# ---------------------------------------------------------------------------- attention and optimizer groups


def explicit_attention(attn, x):
    """Causal self-attention written out: softmax(q k^T / sqrt(hs) + mask) v, then c_proj."""
    B, T, C = x.shape
    nh = attn.n_head
    hs = C // nh
    q, k, v = attn.c_attn(x).split(C, dim=2)
    q, k, v = (t.view(B, T, nh, hs).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)  # (B, nh, T, T)
    future = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
    weights = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    y = (weights @ v).transpose(1, 2).reshape(B, T, C)
    return attn.c_proj(y)


@pytest.mark.parametrize("bias", [False, True])
def test_sdpa_attention_equals_explicit_attention(bias):
    torch.manual_seed(0)
    attn = CausalSelfAttention(GPTConfig(**{**TINY, "n_head": 4, "bias": bias})).eval()
    with torch.no_grad():  # larger weights than the init so the softmax is far from uniform
        for p in attn.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(3, 16, 32)
    with torch.no_grad():
        torch.testing.assert_close(attn(x), explicit_attention(attn, x), atol=1e-6, rtol=1e-5)


def test_configure_optimizers_groups():
    model = tiny_model(bias=True)
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=1e-3, betas=(0.9, 0.95), device_type="cpu")
    in_groups = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(in_groups) == len(set(in_groups))  # no parameter twice (the tied matrix included)
    assert set(in_groups) == {id(p) for p in model.parameters()}
    for group in opt.param_groups:
        for p in group["params"]:
            assert group["weight_decay"] == (0.1 if p.dim() >= 2 else 0.0)
    assert {g["weight_decay"] for g in opt.param_groups} == {0.1, 0.0}


# ---------------------------------------------------------------------------- parameter and FLOPs counts


def gpt2_params_by_hand(L, C, V_padded, bias):
    """Non-embedding parameters of GPT-2 (position embeddings excluded, tied wte/lm_head counted once)."""
    ln = C + bias * C
    attn = (3 * C * C + bias * 3 * C) + (C * C + bias * C)  # c_attn, c_proj
    mlp = (4 * C * C + bias * 4 * C) + (4 * C * C + bias * C)  # c_fc, c_proj
    return V_padded * C + L * (2 * ln + attn + mlp) + ln  # ln_1 and ln_2 in each block, ln_f


@pytest.mark.parametrize("bias", [False, True])
def test_num_params_and_flops_per_token_by_hand(bias):
    model = tiny_model(n_layer=3, n_head=4, bias=bias)
    L, H, C, T = 3, 4, 32, 16
    N = gpt2_params_by_hand(L, C, 128, bias)
    if not bias:
        assert N == 128 * C + L * (12 * C * C + 2 * C) + C  # the familiar 12*L*C^2 form
    assert model.num_params() == N
    assert model.num_params(non_embedding=False) == N + T * C
    # 6 FLOPs per weight per token (2 forward, 4 backward), plus q k^T and att @ v: per layer and
    # head each is 2*T*hs FLOPs forward per token, times 3 for forward and backward
    hs = C // H
    attention = L * H * (2 * 2 * T * hs) * 3
    assert model.flops_per_token() == 6 * N + attention == 6 * N + 12 * L * H * hs * T


# ---------------------------------------------------------------------------- generate


def greedy_by_hand(model, idx, steps):
    for _ in range(steps):
        logits, _ = model(idx[:, -model.config.block_size :])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return idx


@pytest.mark.parametrize("T", [5, 40], ids=["short-prompt", "longer-than-block_size"])
def test_generate_top_k_1_is_greedy_over_the_last_block_size_tokens(T):
    model = tiny_model()
    prompt = random_idx(2, T)
    torch.manual_seed(0)
    first = model.generate(prompt, max_new_tokens=6, temperature=1.0, top_k=1)
    torch.manual_seed(123)
    second = model.generate(prompt, max_new_tokens=6, temperature=1.0, top_k=1)
    assert torch.equal(first, second)
    assert first.shape == (2, T + 6) and torch.equal(first[:, :T], prompt)
    assert torch.equal(first, greedy_by_hand(model, prompt, 6))
    # only the last block_size tokens matter
    cropped = model.generate(prompt[:, -16:], max_new_tokens=6, top_k=1)
    assert torch.equal(first[:, T:], cropped[:, min(T, 16) :])


def test_generate_is_reproducible_under_a_seed():
    model = tiny_model()
    prompt = random_idx(2, 3)
    torch.manual_seed(7)
    a = model.generate(prompt, max_new_tokens=10, temperature=1.5, top_k=10)
    torch.manual_seed(7)
    b = model.generate(prompt, max_new_tokens=10, temperature=1.5, top_k=10)
    assert torch.equal(a, b)
