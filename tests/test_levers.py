"""The speedrun levers (zero_init_proj, logit_softcap, value_embeds, unet_skips, mlp='relu2'): each against its formula
by hand and gradcheck, and together through compile, generation's and the engine's caches, old checkpoints and the
exports. Off (the default) the model is GPT-2's, weight for weight: tests/test_llama.py. train.py's flags into the
checkpoint, resume, 2 ranks, kill -9: tests/test_recipes.py, recipe levers-muon."""

import dataclasses
import math
import re
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import ATEN_BACKEND, CPU, one_line_error, save_checkpoint
from conftest import TINY as TINY_GPT
from processes import run_script
from torch.overrides import TorchFunctionMode

from configurator import TrainConfig, UserError
from gpt.data import tokenizer
from gpt.data.batches import TrainBatches
from gpt.inference import sampling
from gpt.inference.engine import Engine, Request
from gpt.outdir import checkpoint
from gpt.train import optim
from gpt.train.build import build, make_model_args
from gpt.train.step import train_step
from gpt.weights import gguf_export, load
from model import GPT, MLP, CausalSelfAttention, GPTConfig, RMSNorm

TINY = dict(TINY_GPT, n_layer=4, n_head=4)
LEVERS = dict(mlp="relu2", zero_init_proj=True, logit_softcap=15.0, value_embeds=True, unet_skips=True)
OFF = dict(zero_init_proj=False, logit_softcap=0.0, value_embeds=False, unet_skips=False)


def randomized(model, std=0.3, seed=0):
    """model with every parameter drawn afresh (zero projections, unit gates would hide a wrong formula)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model


def tokens(B=2, T=16, vocab=65, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def greedy_by_hand(model, seq, n):
    """seq extended by n tokens, each the argmax of the uncached forward over the whole sequence."""
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq


# ---------------------------------------------------------------------------- each lever by hand


def test_relu2_mlp_is_relu_squared_between_its_two_matmuls():
    config = GPTConfig(**TINY, mlp="relu2")
    assert config.mlp_hidden == 4 * config.n_embd
    mlp = randomized(MLP(config))
    x = torch.randn(2, 5, 32)
    h = x @ mlp.c_fc.weight.T + mlp.c_fc.bias
    expected = torch.where(h > 0, h * h, 0.0) @ mlp.c_proj.weight.T + mlp.c_proj.bias
    torch.testing.assert_close(mlp(x), expected)


def test_logit_softcap_is_cap_tanh_of_the_uncapped_logits_in_training_and_inference():
    plain = randomized(GPT(GPTConfig(**TINY)), std=1.0)  # logits far past the cap
    capped = GPT(GPTConfig(**TINY, logit_softcap=3.0))
    capped.load_state_dict(plain.state_dict())
    idx = tokens()
    z, _ = plain(idx, logits_at="all")
    assert z.abs().max() > 3.0
    logits, loss = capped(idx, idx)
    torch.testing.assert_close(logits, 3.0 * torch.tanh(z / 3.0))
    torch.testing.assert_close(loss, F.cross_entropy((3.0 * torch.tanh(z / 3.0)).flatten(0, 1), idx.flatten()))
    last, _ = capped(idx)  # inference: the last position's, capped the same way
    torch.testing.assert_close(last, 3.0 * torch.tanh(z[:, -1:] / 3.0))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # capped in float32 under autocast too
        assert capped(idx)[0].dtype == torch.float32


def test_loss_only_is_the_same_loss_and_gradients_without_the_logits():
    """train_step's forward (loss_only=True) gives the full forward's loss and gradients, bit for bit."""
    model = randomized(GPT(GPTConfig(**TINY, **LEVERS, qk_norm=True, norm="rmsnorm")), std=0.2)
    idx = tokens()
    grads = []
    for loss_only in (False, True):
        model.zero_grad()
        logits, loss = model(idx, idx, loss_only=loss_only)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
        assert (logits is None) == loss_only
    assert torch.equal(grads[0][0], grads[1][0])
    assert all(torch.equal(a, b) for a, b in zip(grads[0][1], grads[1][1]))
    assert model(idx, loss_only=True)[0].shape == (2, 1, 65)  # without targets there is no loss to keep them in


class RMSNormCalls(TorchFunctionMode):
    """The (input, gain) dtypes of every rms_norm call made while inside."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (F.rms_norm, torch.rms_norm):
            weight = args[2] if len(args) > 2 else kwargs.get("weight")
            self.dtypes.append((args[0].dtype, weight.dtype))
        return func(*args, **kwargs)


def test_rmsnorm_under_bf16_autocast_hands_rms_norm_one_dtype():
    """torch's rms_norm with a float32 gain on bf16 input falls off its fused kernel ("Mismatch dtype"),
    as nn.RMSNorm does below; ours casts the gain. (CUDA's fused kernel: tests/test_gpu.py.)"""
    torch.manual_seed(0)
    ours, theirs = RMSNorm(32, eps=1e-5), torch.nn.RMSNorm(32, eps=1e-5)
    with torch.no_grad():
        ours.weight.normal_(1, 0.5)
        theirs.weight.copy_(ours.weight)
    x = torch.randn(4, 7, 32) * 3
    assert torch.equal(ours(x), theirs(x))
    expected = x.double() / x.double().pow(2).mean(-1, keepdim=True).add(1e-5).sqrt() * ours.weight.double()
    for norm, gain in ((ours, torch.bfloat16), (theirs, torch.float32)):
        with RMSNormCalls() as calls, torch.autocast("cpu", dtype=torch.bfloat16):
            y = norm(x.bfloat16())
        assert calls.dtypes == [(torch.bfloat16, gain)] and y.dtype == torch.bfloat16
        # bf16's 8-bit mantissa: the input, the gain and the output each rounded once
        torch.testing.assert_close(y.double(), expected, rtol=3 * 2**-8, atol=1e-6)
    # every norm of the speedrun's model under autocast: the blocks' and ln_f see the float32 residual
    # stream, QK-norm the bf16 projections; none mixes the two
    model = GPT(GPTConfig(**TINY, **LEVERS, norm="rmsnorm", qk_norm=True))
    with RMSNormCalls() as calls, torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens(), tokens(), loss_only=True)[1].backward()
    assert len(calls.dtypes) == 4 * 4 + 1 and all(a == b for a, b in calls.dtypes)
    assert calls.dtypes.count((torch.bfloat16, torch.bfloat16)) == 4 * 2


def test_value_embedding_attention_adds_the_gated_embedding_to_v():
    config = GPTConfig(**TINY, n_kv_head=2, value_embeds=True)
    attn = randomized(CausalSelfAttention(config, value_embed=True))
    B, T, C, hs = 2, 7, 32, 8
    x, ve = torch.randn(B, T, C), torch.randn(B, T, 2 * hs)
    q, k, v = (x @ attn.c_attn.weight.T + attn.c_attn.bias).split([C, 2 * hs, 2 * hs], dim=-1)
    heads = lambda t, n: t.reshape(B, T, n, hs).transpose(1, 2)
    v = heads(v, 2) + attn.ve_gate[None, :, None, None] * heads(ve, 2)  # each k/v head its own gate
    k, v = (t.repeat_interleave(2, dim=1) for t in (heads(k, 2), v))  # 2 q heads a k/v head
    scores = heads(q, 4) @ k.transpose(-2, -1) / math.sqrt(hs)  # softmax attention written out
    y = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1) @ v
    expected = y.transpose(1, 2).reshape(B, T, C) @ attn.c_proj.weight.T + attn.c_proj.bias
    torch.testing.assert_close(attn(x, ve=ve), expected)


def manual_forward(model, idx):
    """GPT.forward as a loop: block n-1-i (second half) adds skip_weights[i] * block i's output."""
    t, c, n = model.transformer, model.config, model.config.n_layer
    x = t.wte(idx) + t.wpe(torch.arange(idx.size(1)))
    outputs = []
    for i, block in enumerate(t.h):
        mirror = n - 1 - i
        if c.unet_skips and mirror < n // 2 and mirror < i:
            x = x + model.skip_weights[mirror] * outputs[mirror]
        ve = t.ve[str(i)](idx) if c.value_embeds and str(i) in t.ve else None
        x = block(x, ve=ve)
        outputs.append(x)
    logits = model.lm_head(t.ln_f(x))[..., : c.vocab_size]
    return c.logit_softcap * torch.tanh(logits / c.logit_softcap) if c.logit_softcap else logits


@pytest.mark.parametrize("n_layer", [4, 5])
def test_unet_skips_and_value_embeds_match_a_manual_loop_over_the_blocks(n_layer):
    model = randomized(GPT(GPTConfig(**{**TINY, "n_layer": n_layer}, **LEVERS)), std=0.1)
    # value embeddings on every other layer counting back from the last; a skip weight per pair
    ve_layers = [n_layer - 1 - 2 * j for j in range((n_layer + 1) // 2)]
    assert sorted(int(i) for i in model.transformer.ve) == sorted(ve_layers)
    assert [i for i, b in enumerate(model.transformer.h) if hasattr(b.attn, "ve_gate")] == sorted(ve_layers)
    assert model.skip_weights.shape == (n_layer // 2,)
    idx = tokens()
    torch.testing.assert_close(model(idx, logits_at="all")[0], manual_forward(model, idx))
    model.activation_checkpointing = True  # the same blocks, recomputed in backward
    torch.testing.assert_close(model.train()(idx, idx)[0], manual_forward(model, idx))


def test_packed_documents_with_every_lever_each_run_as_if_alone():
    model = randomized(GPT(GPTConfig(**TINY, **LEVERS)), std=0.1)
    idx = tokens(2, 16)
    docs = torch.tensor([[0] * 5 + [1] * 11, [0] * 9 + [1] * 7])  # (B, T): each token's document in its row
    packed = model(idx, idx, docs=docs)[0]
    for row, start in enumerate((5, 9)):
        for part in (slice(0, start), slice(start, 16)):
            alone = model(idx[row : row + 1, part], logits_at="all")[0][0]
            torch.testing.assert_close(packed[row, part], alone, rtol=1e-5, atol=1e-5)


def test_zero_init_proj_starts_projections_at_zero_and_they_still_learn():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, bias=True, zero_init_proj=True))
    projections = {n: p for n, p in model.named_parameters() if ".c_proj." in n}
    assert len(projections) == 4 * 2 * 2  # attention's and the MLP's, weight and bias, in every block
    assert all(torch.equal(p, torch.zeros_like(p)) for p in projections.values())
    # the head keeps its init: a zero head would give no gradient to anything below it
    assert model.lm_head.weight.std() > 0.01
    idx = tokens()
    _, loss = model(idx, idx)
    loss.backward()
    assert all(p.grad.abs().sum() > 0 for p in projections.values()), "zero-init must not stop learning"
    torch.manual_seed(0)  # the init draws what it drew before: every other weight is the default model's
    default = GPT(GPTConfig(**TINY, bias=True)).state_dict()
    assert all(torch.equal(p, default[n]) for n, p in model.state_dict().items() if ".c_proj." not in n)
    optimizer = model.configure_optimizers(0.0, 1e-2, (0.9, 0.95), "cpu")
    optimizer.step()
    assert model(idx, idx)[1] < loss


LEVER_PARAMS = {  # a lever, and the parameters whose gradient it changes
    "relu2": (dict(mlp="relu2"), ["transformer.h.0.mlp.c_fc.weight"]),
    "softcap": (dict(logit_softcap=0.5), ["lm_head.weight"]),
    "value_embeds": (dict(value_embeds=True), ["transformer.ve.1.weight", "transformer.h.1.attn.ve_gate"]),
    "unet_skips": (dict(unet_skips=True), ["skip_weights", "transformer.h.0.attn.c_attn.weight"]),
}


@pytest.mark.parametrize("lever", LEVER_PARAMS)
def test_gradients_through_each_lever_match_finite_differences(lever):
    options, names = LEVER_PARAMS[lever]
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=8, block_size=4, vocab_size=11, tie_embeddings=False, **options))
    model = randomized(model, std=0.5).double()
    params = dict(model.named_parameters())
    idx = tokens(2, 4, 11)

    def loss(*tensors):  # in float64 throughout (the model's own loss is float32)
        weights = {**params, **dict(zip(names, tensors))}
        logits, _ = torch.func.functional_call(model, weights, (idx,), {"logits_at": "all"})
        return F.cross_entropy(logits.flatten(0, 1), idx.flatten())

    inputs = [params[n].detach().clone().requires_grad_() for n in names]
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-6, atol=1e-5, fast_mode=True)


# ---------------------------------------------------------------------------- what the rest of the code does with them


def test_an_old_checkpoint_without_the_keys_loads_with_the_levers_off(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY))
    old_args = {k: v for k, v in dataclasses.asdict(model.config).items() if k not in OFF}
    save_checkpoint(tmp_path / "out", model, {"kind": "char", "chars": "".join(map(chr, range(32, 97)))})
    state = torch.load(tmp_path / "out" / "ckpt.pt", weights_only=True)
    torch.save({**state, "model_args": old_args}, tmp_path / "out" / "ckpt.pt")  # as written before the levers
    loaded, _ = load.for_inference("resume", str(tmp_path / "out"), report=lambda *_: None)
    assert all(getattr(loaded.config, k) == v for k, v in OFF.items())
    idx = tokens()
    assert torch.equal(loaded(idx)[0], model(idx)[0])
    cfg = TrainConfig(**{k: v for k, v in old_args.items() if k != "vocab_size"})
    checkpoint.check_resumable(old_args, make_model_args(cfg, 65))  # resumes under a config without the levers
    changes = [("value_embeds", False, True), ("unet_skips", False, True), ("logit_softcap", 0.0, 30.0)]
    for key, old, new in changes + [("mlp", "gelu", "relu2")]:
        with pytest.raises(UserError, match=f"differs in {key} {old} -> {new};"):  # but not into another model
            checkpoint.check_resumable(old_args, make_model_args(dataclasses.replace(cfg, **{key: new}), 65))


def test_optimizer_groups_param_counts_and_flops():
    model = GPT(GPTConfig(**TINY, **LEVERS))
    named = dict(model.named_parameters())
    extra = [n for n in named if ".ve" in n or "skip" in n]
    assert extra and not any(optim.is_muon_param(n, named[n]) for n in extra)  # tables and gates go to AdamW
    groups = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu").param_groups
    decayed, plain = ({id(p) for p in g["params"]} for g in groups)
    assert all(id(named[n]) in decayed for n in extra if n.startswith("transformer.ve."))  # embeddings decay, as wte
    assert all(id(named[n]) in plain for n in extra if not n.startswith("transformer.ve."))  # gates, skips do not
    # the value embedding tables are lookups: no matmul FLOPs; relu2 has GELU's matmuls
    tables = sum(p.numel() for n, p in named.items() if n.startswith("transformer.ve."))
    gates = sum(p.numel() for n, p in named.items() if "ve_gate" in n or "skip" in n)
    base = GPT(GPTConfig(**TINY))
    assert model.num_params() == base.num_params() + gates
    assert model.num_params(non_embedding=False) == base.num_params(non_embedding=False) + tables + gates
    assert GPT(GPTConfig(**TINY, mlp="relu2")).flops_per_token() == base.flops_per_token()


MIXED = {
    "rope-layernorm-bias": dict(pos_encoding="rope", norm="layernorm", bias=True),  # GPT-2's block with RoPE
    "rope-qknorm-untied-gqa": dict(pos_encoding="rope", bias=True, qk_norm=True, tie_embeddings=False, n_kv_head=2),
    "rmsnorm-learned-relu2": dict(norm="rmsnorm", bias=True, qk_norm=True, mlp="relu2"),
    "speedrun": dict(pos_encoding="rope", norm="rmsnorm", bias=False, qk_norm=True, tie_embeddings=False, **LEVERS),
}


@pytest.mark.parametrize("mixed", MIXED)
def test_llama_and_speedrun_options_train_on_gpt2s_shape(mixed):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY, **MIXED[mixed]}))
    optimizer = model.configure_optimizers(0.0, 2e-3, (0.9, 0.95), "cpu")
    idx = tokens()
    losses = []
    for _ in range(4):
        _, loss = model(idx, idx)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize(
    "options", [dict(LEVERS), dict(LEVERS, pos_encoding="rope", n_kv_head=2)], ids=["learned", "rope-gqa"]
)
def test_cached_greedy_generation_is_the_argmax_of_the_uncached_forward(options):
    model = randomized(GPT(GPTConfig(**{**TINY, **options})), std=0.2).eval()
    idx = tokens(2, 3)
    got = sampling.generate(model, idx, 10, temperature=0)  # a KV cache, prefill then one token a step
    assert torch.equal(got, greedy_by_hand(model, idx, 10))


def test_the_serving_engine_gives_each_request_the_uncached_greedy_tokens():
    model = randomized(GPT(GPTConfig(**{**TINY, **LEVERS}, pos_encoding="rope")), std=0.2).eval()
    prompts, budgets = [[1, 2, 3], [7], [5, 9, 11, 13, 4]], [6, 9, 4]
    solo = [greedy_by_hand(model, torch.tensor([p]), n)[0, len(p) :].tolist() for p, n in zip(prompts, budgets)]
    engine = Engine(model, rows=2, waiting=5).start()  # rows=2: the third joins as another leaves
    outs, done = [[] for _ in prompts], threading.Semaphore(0)
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        assert engine.submit(Request(p, n, outs[i].append, lambda *_: done.release(), temperature=0))
    for _ in prompts:
        assert done.acquire(timeout=60)
    engine.close()
    assert outs == solo


def test_cached_decoding_with_every_lever_is_one_graph(aten_compile):
    model = randomized(GPT(GPTConfig(**{**TINY, "n_layer": 2}, **LEVERS)), std=0.2).eval()  # 2 layers hold every lever
    prompt = tokens(1, 4)
    expected = sampling.generate(model, prompt, 3, temperature=0)
    model.compile(fullgraph=True, backend=ATEN_BACKEND)  # as sample.py compiles it; a graph break is an error
    assert torch.equal(sampling.generate(model, prompt, 3, temperature=0), expected)


def test_all_levers_compile_to_one_graph_that_never_recompiles(aten_compile):
    keys = dict(device="cpu", compile=True, batch_size=4, block_size=16, n_layer=2, n_head=4, n_embd=32)
    cfg = TrainConfig(**keys, gradient_accumulation_steps=2, dropout=0.0, optimizer="muon", **LEVERS)
    torch.manual_seed(0)
    model, train_model, optimizer, scaler = build(GPT(GPTConfig(**make_model_args(cfg, 65))), cfg, CPU)
    data = np.random.default_rng(0).integers(0, 65, size=4000).astype(np.uint16)
    batches = TrainBatches(data, cfg.batch_size, cfg.block_size, 0, CPU)
    step = lambda: train_step(train_model, optimizer, scaler, batches, 1e-3, 2, 1.0, CPU).loss.item()
    losses = [step()]  # warm-up: the one compile
    with torch.compiler.set_stance("fail_on_recompile"):  # new data, same shapes: a recompile is an error
        losses += [step() for _ in range(3)]
    assert all(math.isfinite(x) for x in losses)
    # the model's one graph, and Muon's compiled iteration once per matrix shape (c_attn, attn.c_proj, c_fc, mlp.c_proj)
    assert aten_compile["stats"]["unique_graphs"] == 1 + 4, dict(aten_compile["stats"])
    assert not aten_compile["graph_break"], dict(aten_compile["graph_break"])


# ---------------------------------------------------------------------------- exports


def saved(out_dir, **options):
    """A checkpoint of a GPT-2-shaped model with `options`, as train.py writes one, for hf.py."""
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50257, **options))
    return save_checkpoint(out_dir, model, tokenizer.make_spec("gpt2")), model


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(mlp="relu2"), "mlp='relu2'"),
        (dict(logit_softcap=30.0), "logit_softcap=30.0"),
        (dict(value_embeds=True), "value_embeds=True"),
        (dict(unet_skips=True), "unet_skips=True"),
        # a Llama but for it
        (dict(pos_encoding="rope", norm="rmsnorm", mlp="swiglu", bias=False, unet_skips=True), "unet_skips=True"),
    ],
)
def test_gguf_refuses_each_lever_it_cannot_compute_in_one_line(tmp_path, options, named):
    # (the Hugging Face export takes them: tests/test_hf_recipe.py)
    out_dir, model = saved(tmp_path / "out", **options)
    line = one_line_error(run_script("hf.py", f"--out_dir={out_dir}", "--format=gguf"), named)
    assert line.startswith("error: this model cannot be exported to GGUF: neither")
    assert line.endswith("e.g. python train.py config/train_llama_tiny.py --dataset=shakespeare")
    assert sorted(p.name for p in out_dir.iterdir()) == ["ckpt.pt"]  # nothing written
    # the writer itself refuses them too, for any caller
    with pytest.raises(UserError, match=f"neither GGUF's gpt2 nor its llama computes its {re.escape(named)}") as e:
        gguf_export.write(model, tokenizer.make_spec("gpt2"), str(tmp_path / "model.gguf"), "gpt2")
    assert "\n" not in str(e.value) and not (tmp_path / "model.gguf").exists()


def test_zero_init_proj_is_only_an_init_and_exports(tmp_path):
    from transformers import GPT2LMHeadModel

    out_dir, model = saved(tmp_path / "out", zero_init_proj=True)
    result = run_script("hf.py", f"--out_dir={out_dir}")
    assert result.returncode == 0, result.stderr
    idx = tokens(1, 8, 50257)
    with torch.no_grad():
        theirs = GPT2LMHeadModel.from_pretrained(out_dir / "hf")(idx).logits
        torch.testing.assert_close(theirs, model(idx, logits_at="all")[0][..., :50257], rtol=1e-4, atol=1e-4)
