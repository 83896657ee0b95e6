"""The Llama-style options of model.GPT against explicit formulas and properties. (Exact resume, 2
ranks as 1 and a kill -9 of a Llama-shaped run: tests/test_recipes.py, recipe llama.)"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import TINY_LLAMA, read_metrics
from processes import REPO, run_script

from configurator import TrainConfig, UserError, parse
from gpt.inference.sampling import KVCache, generate
from gpt.outdir.checkpoint import check_resumable
from gpt.train.build import make_model_args
from model import GPT, CausalSelfAttention, GPTConfig, apply_rope, make_norm, rope_tables

LLAMA = dict(TINY_LLAMA, n_head=4, n_kv_head=2, qk_norm=True)
SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)  # Llama 3's


def random_weights(module, std=0.3, seed=0):
    """Weights far from the init, so softmaxes and norms are far from their trivial cases."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, std)
    return module.eval()


def llama(**overrides):
    return random_weights(GPT(GPTConfig(**{**LLAMA, **overrides})))


def idx(B, T, seed=1):
    return torch.randint(0, 65, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- RoPE


def test_rope_depends_only_on_relative_position():
    """The rotation itself: tests/test_hf.py's test_rope_is_transformers_rotation."""
    hs, theta = 16, 10000.0
    cos, sin = rope_tables(hs, 64, theta)
    q, k = torch.randn(2, hs, generator=torch.Generator().manual_seed(0))

    def score(m, n):  # q at position m against k at position n
        rq = apply_rope(q.view(1, 1, 1, hs), cos[m : m + 1], sin[m : m + 1])
        rk = apply_rope(k.view(1, 1, 1, hs), cos[n : n + 1], sin[n : n + 1])
        return (rq * rk).sum().item()

    for m, n in [(5, 2), (9, 9), (3, 7)]:
        for shift in (1, 17, 50):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-4)
    offsets = [score(5, n) for n in range(6)]  # yet the offset itself matters
    assert max(offsets) - min(offsets) > 0.1, offsets

    attn = random_weights(CausalSelfAttention(GPTConfig(**LLAMA)))
    cos, sin = rope_tables(8, 64, 10000.0)
    x = torch.randn(2, 10, 32)
    with torch.no_grad():
        at_0 = attn(x, rope=(cos[:10], sin[:10]))
        at_37 = attn(x, rope=(cos[37:47], sin[37:47]))
    torch.testing.assert_close(at_37, at_0, atol=1e-5, rtol=1e-4)


def test_rope_model_has_no_position_table_and_keeps_its_tables_out_of_checkpoints():
    model = GPT(GPTConfig(**LLAMA))
    assert "wpe" not in model.transformer
    assert not any("rope" in k for k in model.state_dict())
    assert model.rope_cos.shape == (16, 4)  # (block_size, head_size / 2)
    model.crop_block_size(8)
    assert model.rope_cos.shape == (8, 4) and model(idx(1, 8))[0].shape == (1, 1, 65)


# ---------------------------------------------------------------------------- attention: GQA, QK-norm


def explicit_attention(attn, x, rope=None):
    B, T, C = x.shape
    nh, nkv, hs = attn.n_head, attn.n_kv_head, C // attn.n_head
    q, k, v = attn.c_attn(x).split([C, nkv * hs, nkv * hs], dim=2)
    q = q.view(B, T, nh, hs).transpose(1, 2)
    k, v = (t.view(B, T, nkv, hs).transpose(1, 2).repeat_interleave(nh // nkv, dim=1) for t in (k, v))
    if hasattr(attn, "q_norm"):
        rms = lambda t, w: t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    y = (F.softmax(scores, -1) @ v).transpose(1, 2).reshape(B, T, C)
    return attn.c_proj(y)


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_attention_equals_explicit_gqa(n_kv_head, qk_norm):
    attn = random_weights(CausalSelfAttention(GPTConfig(**{**LLAMA, "n_kv_head": n_kv_head, "qk_norm": qk_norm})))
    cos, sin = rope_tables(8, 16, 10000.0)
    x = torch.randn(3, 16, 32)
    with torch.no_grad():
        for rope in (None, (cos, sin)):  # learned positions' attention, and RoPE's
            torch.testing.assert_close(attn(x, rope=rope), explicit_attention(attn, x, rope), atol=1e-6, rtol=1e-5)


def test_n_kv_head_equal_to_n_head_is_plain_multi_head_attention():
    models = []
    for n_kv_head in (0, 4):
        torch.manual_seed(0)
        models.append(GPT(GPTConfig(**{**LLAMA, "n_kv_head": n_kv_head})).eval())
    a, b = (m.state_dict() for m in models)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["transformer.h.0.attn.c_attn.weight"].shape == (3 * 32, 32)
    x = idx(2, 16)
    assert torch.equal(models[0](x, logits_at="all")[0], models[1](x, logits_at="all")[0])


# ---------------------------------------------------------------------------- norms and MLPs


def test_rmsnorm_formula():
    norm = make_norm(GPTConfig(norm="rmsnorm"), 32)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(4, 7, 32) * 3 + 1
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), expected)
    assert not any(n.endswith("bias") for n, _ in norm.named_parameters())


# the MLPs' formulas (exact and tanh GELU, SwiGLU): tests/test_hf.py's import and export tests, against
# transformers' GPT-2 and Llama


@pytest.mark.parametrize(
    "mlp, n_embd, hidden",
    [("gelu", 64, 256), ("gelu_tanh", 64, 256), ("swiglu", 64, 192), ("swiglu", 768, 2048), ("swiglu", 100, 320)],
)
def test_mlp_hidden_zero_means_the_usual_width(mlp, n_embd, hidden):
    # GELU: 4x; SwiGLU: 8/3x rounded up to a multiple of 64, the same weights as GELU's 4x (768 -> 2048 exactly)
    assert GPTConfig(n_embd=n_embd, n_head=4, mlp=mlp).mlp_hidden == hidden


def test_swiglu_init_scales_its_down_projection_like_gpt2s_c_proj():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**LLAMA, "n_layer": 8, "n_embd": 128, "mlp_hidden": 512}))
    assert abs(model.transformer.h[0].mlp.c_proj.weight.std().item() - 0.02 / math.sqrt(16)) < 0.0005
    assert abs(model.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.0005
    assert all(torch.all(m.weight == 1) for m in model.modules() if isinstance(m, nn.RMSNorm))


# ---------------------------------------------------------------------------- embeddings, counts, FLOPs


def llama_params_by_hand(L, C, nh, nkv, H, V, tied, qk_norm):
    hs = C // nh
    per_block = C + C * (C + 2 * nkv * hs) + C * C + C + C * 2 * H + H * C + qk_norm * 2 * hs  # no biases
    return V * C * (1 if tied else 2) + L * per_block + C


def test_llama_1b_recipe_has_llama_3_2_1b_parameter_count():
    cfg = parse(TrainConfig, [str(REPO / "config/train_llama_1b.py")])
    with torch.device("meta"):
        model = GPT(GPTConfig(**make_model_args(cfg, 128256)))
    n = model.num_params(non_embedding=False)
    assert n == llama_params_by_hand(16, 2048, 32, 8, 8192, 128256, tied=True, qk_norm=False) == 1_235_814_400
    assert cfg.block_size * cfg.batch_size * cfg.gradient_accumulation_steps == 2**20  # ~1M tokens per step
    assert 19e9 < cfg.max_iters * 2**20 < 21e9  # ~20B tokens


def test_untied_embeddings_and_flops_per_token_by_hand_for_a_llama_style_model():
    L, C, nh, nkv, H, V, T = 3, 64, 8, 2, 96, 128, 32  # V: vocab_size=65's padded rows, parameters too
    shape = dict(n_layer=L, n_embd=C, n_head=nh, n_kv_head=nkv, mlp_hidden=H, block_size=T, vocab_size=65)
    model = GPT(GPTConfig(**dict(TINY_LLAMA, **shape, qk_norm=True)))  # RoPE, RMSNorm, SwiGLU, untied, no biases
    assert model.transformer.wte.weight is not model.lm_head.weight
    assert {"transformer.wte.weight", "lm_head.weight"} <= model.state_dict().keys()
    n_all = llama_params_by_hand(L, C, nh, nkv, H, V, tied=False, qk_norm=True)
    assert model.num_params(non_embedding=False) == n_all == sum(p.numel() for p in model.parameters())
    N = n_all - V * C  # the untied wte is a lookup: it does no matmul work; lm_head does
    assert model.num_params() == N
    # attention's scores and weighted values, per query head: 2 * (2 T hs) forward, x3 with backward
    assert model.flops_per_token() == 6 * N + L * nh * (2 * 2 * T * (C // nh)) * 3


# ---------------------------------------------------------------------------- generation, checkpointing


def test_cached_step_logits_equal_a_full_forward_for_a_llama_model():
    model = llama()
    x = idx(3, 6)
    cache = KVCache(model.config, 3)
    assert cache.shape == (2, 3, 2, 16, 8)  # the cache holds n_kv_head heads
    logits, _ = model(x, cache=cache)
    for _ in range(9):
        full, _ = model(x)
        torch.testing.assert_close(logits, full, atol=1e-5, rtol=1e-5)
        x = torch.cat([x, full[:, -1].argmax(-1, keepdim=True)], dim=1)
        logits, _ = model(x[:, -1:], cache=cache)


@pytest.mark.parametrize("window_shift", [1, 5])
def test_cached_generation_equals_uncached_past_block_size(window_shift):
    model = llama()
    prompt = idx(3, 5)
    # 45 tokens, block_size 16
    uncached = generate(model, prompt, 40, temperature=0, kv_cache=False, window_shift=window_shift)
    # by hand: the last block_size tokens (or the window a larger shift keeps) through the whole model
    out, start = prompt, 0
    for _ in range(40):
        if out.size(1) - start > 16:
            start = out.size(1) - (16 - window_shift + 1)
        logits, _ = model(out[:, start:])
        out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(uncached, out)
    assert torch.equal(generate(model, prompt, 40, temperature=0, window_shift=window_shift), out)


def test_activation_checkpointing_gives_the_same_gradients():
    """Recomputing each block in backward changes memory, not math; dropout masks replay."""
    grads = []
    for on in (False, True):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**LLAMA, "dropout": 0.2})).train()
        model.activation_checkpointing = on
        torch.manual_seed(1)
        _, loss = model(idx(2, 16), idx(2, 16, seed=2))
        loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


# ---------------------------------------------------------------------------- the GPT-2 default, pinned


def reference_gpt2_weights(seed, L, C, V, T, bias):
    """GPT-2's weights as GPT(GPTConfig()) made them before the Llama options existed: modules created in
    this order (each constructor draws from the RNG), then the 0.02 normal init in module order (the tied
    wte is lm_head's, drawn last), zero biases, and the residual projections redrawn with std 0.02/sqrt(2L)."""
    torch.manual_seed(seed)
    ln, linear = lambda: nn.LayerNorm(C, bias=bias), lambda n_in, n_out: nn.Linear(n_in, n_out, bias=bias)
    wte, wpe = nn.Embedding(V, C), nn.Embedding(T, C)
    blocks = [[ln(), linear(C, 3 * C), linear(C, C), ln(), linear(C, 4 * C), linear(4 * C, C)] for _ in range(L)]
    ln_f, lm_head = ln(), nn.Linear(C, V, bias=False)
    for m in [wte, wpe, *(m for b in blocks for m in b), ln_f, lm_head]:
        if not isinstance(m, nn.LayerNorm):
            nn.init.normal_(m.weight, 0.0, 0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
    for b in blocks:
        for proj in (b[2], b[5]):
            nn.init.normal_(proj.weight, 0.0, 0.02 / math.sqrt(2 * L))
    w = {"transformer.wte.weight": lm_head.weight, "transformer.wpe.weight": wpe.weight}
    names = ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj")
    for i, b in enumerate(blocks):
        for name, m in zip(names, b):
            w[f"transformer.h.{i}.{name}.weight"] = m.weight
            if m.bias is not None:
                w[f"transformer.h.{i}.{name}.bias"] = m.bias
    w["transformer.ln_f.weight"] = ln_f.weight
    if bias:
        w["transformer.ln_f.bias"] = ln_f.bias
    w["lm_head.weight"] = lm_head.weight
    return {k: v.detach() for k, v in w.items()}


@pytest.mark.parametrize("bias", [True, False])
def test_gpt2_default_is_unchanged(bias):
    """So a seeded run trains the same. Its logits are GPT-2's:
    tests/test_hf.py's test_export_logits_match_transformers[gpt2-gelu, gpt2-no-bias]."""
    L, C, nh, V, T = 2, 32, 4, 65, 16
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=L, n_head=nh, n_embd=C, block_size=T, vocab_size=V, bias=bias)).eval()
    reference = reference_gpt2_weights(0, L, C, 128, T, bias)
    state = model.state_dict()
    assert list(state) == list(reference)
    assert all(torch.equal(state[k], reference[k]) for k in state), "same seed, different weights"
    assert model.transformer.wte.weight is model.lm_head.weight


# ---------------------------------------------------------------------------- train.py: keys, resume, a CPU run


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--n_head=4", "--n_embd=32", "--n_kv_head=3"], "n_kv_head=3"),
        (["--n_head=4", "--n_embd=32", "--n_kv_head=8"], "n_kv_head=8"),
        (["--n_head=4", "--n_embd=12", "--pos_encoding=rope"], "head size"),
        (["--pos_encoding=alibi"], "pos_encoding='alibi'"),
        (["--norm=batchnorm"], "norm='batchnorm'"),
        (["--mlp=relu"], "mlp='relu'"),
        (["--parallelism=zero3"], "parallelism='zero3'"),
        (["--mlp_hidden=-1"], "mlp_hidden"),
        ([f"--rope_scaling={SCALING}"], "needs pos_encoding='rope'"),
        (["--pos_encoding=rope", "--rope_scaling={'factor': 8.0}"], "must have exactly the numbers"),
        (["--pos_encoding=rope", f"--rope_scaling={dict(SCALING, low_freq_factor=5.0)}"], "low_freq_factor < high"),
        (["--norm_eps=0"], "norm_eps=0"),
    ],
)
def test_bad_llama_keys_are_one_line_errors(argv, expected):
    with pytest.raises(UserError, match=expected):
        parse(TrainConfig, argv)


def test_resume_refuses_another_architecture_and_accepts_old_checkpoints():
    cfg = parse(TrainConfig, [str(REPO / "config/train_llama_tiny.py")])
    args = make_model_args(cfg, 65)
    check_resumable(args, {**args, "dropout": 0.3, "n_kv_head": 1})  # dropout is not the architecture
    with pytest.raises(UserError, match=r"norm rmsnorm -> layernorm, qk_norm False -> True"):
        check_resumable(args, {**args, "norm": "layernorm", "qk_norm": True})
    # a checkpoint from before these keys existed holds only GPT-2's keys: they mean GPT-2
    old = {"n_layer": 2, "n_head": 4, "n_embd": 32, "block_size": 16, "bias": False, "vocab_size": 65, "dropout": 0.0}
    gpt2 = make_model_args(parse(TrainConfig, ["--n_layer=2", "--n_head=4", "--n_embd=32", "--block_size=16"]), 65)
    check_resumable(old, gpt2)
    check_resumable(old, {**gpt2, "n_kv_head": 4})  # 0 and n_head are the same attention
    with pytest.raises(UserError, match="pos_encoding learned -> rope"):
        check_resumable(old, {**gpt2, "pos_encoding": "rope"})
    # the RoPE scaling and norm_eps are recorded, and a change of either is another model
    assert GPTConfig().rope_scaling is None
    argv = ["--pos_encoding=rope", f"--rope_scaling={SCALING}", "--norm_eps=1e-6"]
    scaled = make_model_args(parse(TrainConfig, argv), 65)
    assert scaled["rope_scaling"] == SCALING and scaled["norm_eps"] == 1e-6
    with pytest.raises(UserError, match="rope_scaling"):
        check_resumable(scaled, {**scaled, "rope_scaling": dict(SCALING, factor=4.0)})
    with pytest.raises(UserError, match="norm_eps"):
        check_resumable(scaled, {**scaled, "norm_eps": 1e-5})


def test_tiny_llama_trains_on_cpu_and_samples(char_data, tmp_path):
    out = tmp_path / "out"
    run = ["config/train_llama_tiny.py", f"--dataset={char_data}", f"--out_dir={out}", "--max_iters=60"]
    run += "--lr_decay_iters=60 --warmup_iters=5 --eval_interval=30 --eval_iters=4 --log_interval=10".split()
    result = run_script("train.py", *run, "--batch_size=8", "--block_size=32")
    assert result.returncode == 0, result.stderr
    evals = [r["val_loss"] for r in read_metrics(out) if "val_loss" in r]
    assert len(evals) == 3 and evals[-1] < evals[0] - 0.8, evals  # it learned
    state = torch.load(out / "ckpt.pt", weights_only=True)
    assert state["model_args"]["pos_encoding"] == "rope" and state["model_args"]["n_kv_head"] == 1
    assert "transformer.wpe.weight" not in state["model"]
    sample = "--device=cpu --num_samples=1 --max_new_tokens=40 --start=The --stream=False".split()
    sampled = run_script("sample.py", f"--out_dir={out}", *sample)
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.count("The") >= 1
