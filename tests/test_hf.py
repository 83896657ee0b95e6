"""Hugging Face weights in and out (hf.py) against transformers' own GPT2LMHeadModel and
LlamaForCausalLM, built locally (no hub): each property once for both architectures."""

import copy
import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import make_text, needs, one_line_error
from processes import run_python, run_script

needs("transformers")
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import hf
import sample
from configurator import TrainConfig, UserError, parse
from data import corpus
from gpt.data import tokenizer
from gpt.outdir import checkpoint
from gpt.weights import huggingface, load
from model import GPT, GPTConfig, apply_rope, rope_tables

# GPT-2's vocab: 50257 rows padded to 50304
SMALL = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=50257, n_positions=64)
V = 96  # the Llamas' vocab
LLAMA = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
LLAMA.update(max_position_embeddings=128, rope_theta=10000.0)
# with head size 16 and theta 1e4 over a 32-token original context, pair 0 turns ~5 times (kept),
# pair 1 ~1.6 times (smoothed) and the rest less than once (slowed 8x): every branch of the scaling
SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)  # ours
LLAMA3 = {"rope_type": "llama3", **SCALING}  # as transformers' rope_scaling holds it
T = 48  # the Llamas' test length: longer than LLAMA3's original context

LLAMA_CASES = {
    "gqa-llama3-tied-eps1e-5": dict(
        num_key_value_heads=2, rope_scaling=LLAMA3, tie_word_embeddings=True, rms_norm_eps=1e-5
    ),
    "gqa-llama3-untied-eps1e-6": dict(
        num_key_value_heads=1, rope_scaling=LLAMA3, tie_word_embeddings=False, rms_norm_eps=1e-6
    ),
    "mha-plain-untied-biases": dict(
        num_key_value_heads=4, tie_word_embeddings=False, rms_norm_eps=1e-6, attention_bias=True, mlp_bias=True
    ),
}

# meta-llama/Llama-3.2-1B's config.json as published
LLAMA_3_2_1B = json.loads("""{
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 128000,
  "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
  "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
  "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0", "use_cache": true,
  "vocab_size": 128256
}""")


# what each architecture's test models are, and which of our GPTConfig keys its config holds (and how)
GPT2_MLP = {"gelu": "gelu", "gelu_new": "gelu_tanh"}  # activation_function -> our mlp
TRAINER_KEYS = ("n_kv_head", "norm_eps", "bias", "mlp", "mlp_hidden", "pos_encoding", "norm", "qk_norm")
ARCH = {
    "gpt2": SimpleNamespace(
        tol=1e-5,  # float32
        vocab=50257,
        length=64,
        hf_class="GPT2LMHeadModel",
        ours=lambda c: (c.mlp, c.mlp_hidden, c.norm_eps, c.tie_embeddings),
        theirs=lambda c: (
            GPT2_MLP[c.activation_function],
            c.n_inner or 4 * c.n_embd,
            c.layer_norm_epsilon,
            c.tie_word_embeddings,
        ),
    ),
    "llama": SimpleNamespace(
        tol=1e-4,  # float32
        vocab=V,
        length=T,
        hf_class="LlamaForCausalLM",
        ours=lambda c: (c.n_kv_head, c.mlp_hidden, c.norm_eps, c.tie_embeddings, c.bias, c.rope_scaling),
        theirs=lambda c: (
            c.num_key_value_heads,
            c.intermediate_size,
            c.rms_norm_eps,
            c.tie_word_embeddings,
            c.attention_bias,
            # transformers 5 writes {"rope_type": "default", ...} for no scaling
            {k: c.rope_scaling[k] for k in SCALING} if (c.rope_scaling or {}).get("rope_type") == "llama3" else None,
        ),
    ),
    # hf.py's own GPTTrainerForCausalLM (tests/test_hf_recipe.py): its config.json holds our keys
    "gpt_trainer": SimpleNamespace(
        tol=1e-5,
        vocab=65,
        length=32,
        hf_class="GPTTrainerForCausalLM",
        ours=lambda c: (*(getattr(c, k) for k in TRAINER_KEYS), c.tie_embeddings, c.rope_scaling),
        theirs=lambda c: (*(getattr(c, k) for k in TRAINER_KEYS), c.tie_word_embeddings, c.rope_frequency_scaling),
    ),
}


def randomize(module, seed=0, std=0.2):
    """Biases and norm gains too: at init they are 0 and 1 on both sides, and a miscopied one would not show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module.eval()


def tokens(arch, length=None, B=2):
    vocab, length = ARCH[arch].vocab, length or ARCH[arch].length
    return torch.randint(0, vocab, (B, length), generator=torch.Generator().manual_seed(1))


def max_diff(a, b):
    return (a - b).abs().max().item()


@torch.no_grad()
def our_logits(model, idx):
    return model.eval()(idx, logits_at="all")[0]


@torch.no_grad()
def their_logits(hf_model, idx):
    return hf_model.eval()(idx).logits


def gpt2_reference(seed=0, std=0.2, **options):
    return randomize(transformers.GPT2LMHeadModel(transformers.GPT2Config(**SMALL, **options)), seed, std)


def llama_config(case, **overrides):
    # a copy: transformers adds rope_theta to the rope_scaling dict it is given
    return transformers.LlamaConfig(**copy.deepcopy({**LLAMA, **LLAMA_CASES[case], **overrides}))


def llama_reference(case, seed=0, std=0.2, **overrides):
    return randomize(transformers.LlamaForCausalLM(llama_config(case, **overrides)), seed, std)


# ---------------------------------------------------------------------------- in: transformers -> ours


IMPORTS = {  # id: (the architecture, transformers' config options or a LLAMA_CASES key, the shard size)
    "gpt2-gelu": ("gpt2", dict(activation_function="gelu"), None),  # exact GELU, our default
    "gpt2-gelu_new": ("gpt2", dict(activation_function="gelu_new"), None),  # the released models' tanh approximation
    "gpt2-untied-eps1e-2": (
        "gpt2",
        dict(activation_function="gelu_new", n_inner=96, tie_word_embeddings=False, layer_norm_epsilon=1e-2),
        None,
    ),
    **{f"llama-{case}": ("llama", case, None) for case in LLAMA_CASES},
    "llama-sharded": ("llama", "gqa-llama3-untied-eps1e-6", "40KB"),
}


@pytest.mark.parametrize("arch, options, shard_size", IMPORTS.values(), ids=list(IMPORTS))
def test_import_logits_match_transformers(tmp_path, arch, options, shard_size):
    theirs = gpt2_reference(**options) if arch == "gpt2" else llama_reference(options)
    theirs.save_pretrained(tmp_path / "hf", max_shard_size=shard_size or "5GB")
    if shard_size:  # sharded safetensors: model-*-of-*.safetensors and their index
        assert len(list((tmp_path / "hf").glob("model-*-of-*.safetensors"))) > 2
        assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    if arch == "gpt2":
        expected = huggingface.GPT2_TOKENIZER
    else:  # the directory's own tokenizer.json, of two tokens, as every Llama directory has one
        tok = Tokenizer(models.WordLevel({"<|end_of_text|>": 0, "<unk>": 1}, unk_token="<unk>"))
        tok.save(str(tmp_path / "hf" / "tokenizer.json"))
        expected = {"kind": "tokenizers", "path": str(tmp_path / "hf" / "tokenizer.json")}
    model, tok_spec = load.pretrained(str(tmp_path / "hf"))
    assert isinstance(model, GPT) and {k: tok_spec[k] for k in expected} == expected
    idx = tokens(arch)
    assert max_diff(our_logits(model, idx), their_logits(theirs, idx)) <= ARCH[arch].tol
    assert ARCH[arch].ours(model.config) == ARCH[arch].theirs(theirs.config)
    assert (model.transformer.wte.weight is model.lm_head.weight) == theirs.config.tie_word_embeddings
    # its model_args rebuild the same model, as sample.py and resume do from a checkpoint
    rebuilt = GPT(GPTConfig(**dataclasses.asdict(model.config)))
    rebuilt.load_state_dict(model.state_dict())
    assert torch.equal(our_logits(rebuilt, idx), our_logits(model, idx))


def test_init_from_is_validated(tmp_path):
    with pytest.raises(UserError, match="init_from='gpt7' is not one of"):
        parse(TrainConfig, ["--init_from=gpt7"])
    assert parse(TrainConfig, ["--init_from=gpt2-xl"]).init_from == "gpt2-xl"
    cfg = parse(TrainConfig, [f"--init_from={tmp_path}"])
    assert cfg.init_from == str(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')  # a GPT-2 directory
    with pytest.raises(UserError, match="needs data tokenized with GPT-2's BPE"):
        load.for_training(cfg, {"kind": "char", "chars": "ab"})


@pytest.mark.process
def test_an_unreachable_hub_is_a_one_line_error(tmp_path):
    # an empty cache and no network: it must fail at once, saying what to do instead
    # isolated: huggingface_hub reads HF_HUB_OFFLINE and HF_HOME when it is imported
    offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    result = run_script("sample.py", "--init_from=gpt2", "--device=cpu", env=offline, isolated=True)
    line = one_line_error(result)
    assert result.returncode == 2 and line.startswith("error: cannot download 'gpt2' from Hugging Face")
    assert line.endswith("pass a local directory: --init_from=/path/to/gpt2")


@pytest.mark.process
def test_nanogpt_from_pretrained_gives_transformers_logits(tmp_path):
    # nanoGPT's own line, `GPT.from_pretrained("gpt2", dict(dropout=0.0))`, offline: a tiny random
    # GPT-2 saved into a Hugging Face cache under the released name, read with the hub switched off
    snapshot = tmp_path / "hub" / "models--gpt2" / "snapshots" / ("0" * 40)
    gpt2_reference(activation_function="gelu_new").save_pretrained(snapshot)
    (tmp_path / "hub" / "models--gpt2" / "refs").mkdir()
    (tmp_path / "hub" / "models--gpt2" / "refs" / "main").write_text("0" * 40)
    script = (
        "import torch\n"
        "from transformers import GPT2LMHeadModel\n"
        "from model import GPT\n"
        "model = GPT.from_pretrained('gpt2', dict(dropout=0.0)).eval()\n"
        "reference = GPT2LMHeadModel.from_pretrained('gpt2').eval()\n"
        "idx = torch.randint(0, 50257, (2, 64), generator=torch.Generator().manual_seed(1))\n"
        "with torch.no_grad():\n"
        "    ours, theirs = model(idx, logits_at='all')[0], reference(idx).logits\n"
        "assert model.config.mlp == 'gelu_tanh' and model.config.dropout == 0.0\n"
        "print((ours - theirs).abs().max().item())\n"
    )
    # a process of its own: huggingface_hub reads HF_HUB_OFFLINE and HF_HUB_CACHE when it is imported
    result = run_python(["-c", script], env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert result.returncode == 0, result.stderr
    assert float(result.stdout.strip().splitlines()[-1]) <= ARCH["gpt2"].tol


def test_chat_data_takes_gpt2s_padding_rows_for_its_turn_tokens(tmp_path):
    reference = gpt2_reference()
    reference.save_pretrained(tmp_path / "gpt2")
    cfg = parse(TrainConfig, [f"--init_from={tmp_path / 'gpt2'}", "--block_size=64", "--dropout=0.0"])
    notes = []
    turn_ids = [50257, 50258, 50259, 50260]  # what gpt/data/chat_template.py gives GPT-2
    roles = {n: {"id": i} for n, i in zip(("system", "user", "assistant", "end"), turn_ids)}
    chat = {"format": "role_tokens", "tokens": {"bos": {"id": 50256}, **roles}}
    chat_spec = {**huggingface.GPT2_TOKENIZER, "vocab_size": 50261, "chat": chat}
    model, model_args = load.for_training(cfg, chat_spec, report=notes.append)
    assert model.config.vocab_size == model_args["vocab_size"] == 50261 and model.config.padded_vocab_size == 50304
    wte = model.transformer.wte.weight
    mean = wte[:50257].mean(dim=0)
    assert all(torch.equal(wte[i], mean) for i in turn_ids) and not wte[50261:].any()
    idx = tokens("gpt2")
    # GPT-2's tokens unchanged
    assert max_diff(our_logits(model, idx)[..., :50257], their_logits(reference, idx)) <= ARCH["gpt2"].tol
    assert any("the chat template's turn tokens 50257, 50258, 50259, 50260 start as the mean" in n for n in notes)
    # without chat data (or past the padding) a larger tokenizer is still refused
    with pytest.raises(UserError, match="more than the vocab_size=50257"):
        load.for_training(cfg, {**huggingface.GPT2_TOKENIZER, "vocab_size": 50261}, report=notes.append)
    far = {**chat_spec, "vocab_size": 50400, "chat": {"format": "role_tokens", "tokens": {"end": {"id": 50399}}}}
    with pytest.raises(UserError, match="more than the vocab_size=50257"):
        load.for_training(cfg, far, report=notes.append)


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["plain", "llama3"])
def test_rope_is_transformers_rotation(scaling):
    """The same half-split layout, pairing dims (i, i + hs/2): q and k rows are copied without a permutation."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = transformers.LlamaConfig(**LLAMA, rope_scaling=copy.deepcopy(scaling))
    hs = 16
    q, k = torch.randn(2, 4, T, hs), torch.randn(2, 2, T, hs)
    cos, sin = LlamaRotaryEmbedding(config)(q, torch.arange(T)[None])  # (1, T, hs): each angle twice
    ours_cos, ours_sin = rope_tables(hs, T, 10000.0, None if scaling is None else SCALING)
    torch.testing.assert_close(torch.cat([ours_cos, ours_cos], -1), cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat([ours_sin, ours_sin], -1), sin[0], atol=1e-6, rtol=0)
    their_q, their_k = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(apply_rope(q, ours_cos, ours_sin), their_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(apply_rope(k, ours_cos, ours_sin), their_k, atol=1e-6, rtol=0)
    if scaling is not None:  # and the scaling does something at these sizes
        assert max_diff(ours_cos, rope_tables(hs, T, 10000.0)[0]) > 0.1


def test_llama_3_2_1b_config_builds_with_its_parameter_count(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_2_1B))
    model_args = huggingface.llama_model_args(huggingface.read_config(str(tmp_path)))
    with torch.device("meta"):
        model = GPT(GPTConfig(**model_args))
    assert model.num_params(non_embedding=False) == 1_235_814_400
    c = model.config
    shape = (c.n_layer, c.n_head, c.n_kv_head, c.n_embd, c.mlp_hidden, c.block_size, c.vocab_size)
    assert shape == (16, 32, 8, 2048, 8192, 131072, 128256)
    assert (c.rope_theta, c.norm_eps, c.tie_embeddings, c.bias) == (500000.0, 1e-5, True, False)
    assert c.rope_scaling == dict(SCALING, factor=32.0, original_max_position_embeddings=8192)  # the 1B's


# ---------------------------------------------------------------------------- out: ours -> transformers


EXPORTS = {  # id: (the architecture it exports to, our GPTConfig's options or a LLAMA_CASES key)
    "gpt2-gelu": ("gpt2", dict()),  # GPT-2's shape, exact GELU
    "gpt2-gelu_tanh": ("gpt2", dict(mlp="gelu_tanh")),
    "gpt2-no-bias": ("gpt2", dict(bias=False)),  # exported as zero biases, which add nothing
    "gpt2-untied-eps1e-2": ("gpt2", dict(tie_embeddings=False, mlp_hidden=96, norm_eps=1e-2)),  # as layer_norm_epsilon
    # nanoGPT's padded vocabulary: the export keeps GPT-2's 50257 tokens
    "gpt2-padded-vocab": ("gpt2", dict(vocab_size=50304)),
    **{f"llama-{case}": ("llama", case) for case in LLAMA_CASES},
    # models neither computes: GPTTrainerForCausalLM (tests/test_hf_recipe.py trains and exports a run of it)
    # learned positions with RMSNorm: neither GPT-2 nor Llama
    "gpt_trainer-rmsnorm-learned": ("gpt_trainer", dict(norm="rmsnorm", mlp="gelu_tanh")),
    "gpt_trainer-layernorm-llama": (  # LayerNorm and biases in a Llama
        "gpt_trainer",
        dict(pos_encoding="rope", mlp="swiglu", n_kv_head=1)
        | dict(rope_scaling=dict(SCALING, factor=4.0, original_max_position_embeddings=16)),
    ),
    "gpt_trainer-qk_norm-llama": (
        "gpt_trainer",
        dict(pos_encoding="rope", norm="rmsnorm", mlp="swiglu", bias=False, qk_norm=True, tie_embeddings=False),
    ),
    "gpt_trainer-recipe": (  # config/train_shakespeare_char_cpu.py's levers, tied, 4 layers, no softcap
        "gpt_trainer",
        dict(bias=False, pos_encoding="rope", norm="rmsnorm", qk_norm=True, mlp="relu2", tie_embeddings=True)
        | dict(zero_init_proj=True, logit_softcap=0.0, value_embeds=True, unet_skips=True, n_layer=4),
    ),
}


@pytest.mark.parametrize("arch, options", EXPORTS.values(), ids=list(EXPORTS))
def test_export_logits_match_transformers(tmp_path, arch, options):
    if arch == "gpt2":
        shape = dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=50257)
        tok_spec = huggingface.GPT2_TOKENIZER
    elif arch == "llama":
        shape, options = huggingface.llama_model_args(llama_config(options).to_dict()), {}
        tok_spec = {"kind": "char", "chars": "x" * V}
    else:
        shape = dict(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=65)
        tok_spec = {"kind": "char", "chars": "".join(chr(32 + i) for i in range(65))}
    model = randomize(GPT(GPTConfig(**{**shape, **options})))
    idx = tokens(arch)
    ours = our_logits(model, idx)[..., : ARCH[arch].vocab]
    assert huggingface.export(model, tok_spec, str(tmp_path / "hf")) == arch
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    assert type(exported).__name__ == ARCH[arch].hf_class and exported.config.vocab_size == ARCH[arch].vocab
    assert max_diff(their_logits(exported, idx), ours) <= ARCH[arch].tol
    assert ARCH[arch].theirs(exported.config) == ARCH[arch].ours(model.config)
    # and back: the exported directory imports to the same model
    again, _, kind = huggingface.load(str(tmp_path / "hf"))
    assert kind == arch
    assert max_diff(our_logits(again, idx), ours) <= ARCH[arch].tol


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(pos_encoding="rope"), "pos_encoding='rope'"),
        (dict(norm="rmsnorm"), "norm='rmsnorm'"),
        (dict(mlp="swiglu"), "mlp='swiglu'"),
        (dict(n_kv_head=2), "n_kv_head=2"),
        (dict(qk_norm=True), "qk_norm=True"),
        (dict(pos_encoding="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True), "qk_norm=True"),  # a Llama's but one
    ],
    ids=["rope", "rmsnorm", "swiglu", "gqa", "qk_norm", "llama-qk_norm"],
)
def test_models_neither_class_computes_export_as_our_own(options, named):
    # GPTTrainerForCausalLM, whose logits test_export_logits_match_transformers[gpt_trainer-*] checks
    config = GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=16, vocab_size=65, **options)
    with pytest.raises(UserError, match=named):
        huggingface.hf_config(config, 65)
    assert huggingface.export_architecture(config) == "gpt_trainer"
    # a Llama is still a Llama
    llama = dataclasses.replace(config, pos_encoding="rope", norm="rmsnorm", mlp="swiglu", qk_norm=False)
    assert huggingface.export_architecture(llama) == "llama"


# ---------------------------------------------------------------------------- finetuning end to end

PROMPT = "The king"


def make_bpe_tokenizer(path):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([make_text(5000, seed=9)], trainer)
    tok.save(str(path))
    return tok.get_vocab_size()


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def finetuned(request, tmp_path_factory):
    """4 steps from a small directory: a GPT-2 by config/finetune_shakespeare.py on GPT-2 BPE data, or a tiny
    Llama with its own tokenizer.json on data prepared with that tokenizer."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    run = [
        f"--dataset={root / 'data'}",
        f"--out_dir={root / 'out'}",
        "--device=cpu",
        "--compile=False",
        "--eval_iters=2",
    ]
    if arch == "gpt2":
        reference = gpt2_reference(std=0.05)
        encode, _ = tokenizer.load(huggingface.GPT2_TOKENIZER)
        ids = np.array(encode(make_text(20000)), dtype=np.uint16)  # headerless uint16, as prepare.py writes
        (root / "data").mkdir()
        ids[: len(ids) * 9 // 10].tofile(root / "data" / "train.bin")
        ids[len(ids) * 9 // 10 :].tofile(root / "data" / "val.bin")
        flags = "--block_size=32 --gradient_accumulation_steps=2 --eval_interval=2".split()
        run, cropped = ["config/finetune_shakespeare.py", *run, *flags], "64 cropped to 32"
        model_args = dict(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=50257, bias=True, mlp="gelu_tanh")
        f = SimpleNamespace(
            tokenizer={"kind": "tiktoken", "name": "gpt2"},
            tok_spec=huggingface.GPT2_TOKENIZER,
            pad=50256,
            eos="<|endoftext|>",
            bos="<|endoftext|>",
            known_ids={"Hello world": [15496, 995]},  # GPT-2's own
            files={"config.json", "generation_config.json", "model.safetensors", "vocab.json", "merges.txt"},
            model_args=model_args,
            shapes={"transformer.wpe.weight": (32, 64)},  # cropped from 64 positions
            # 4 AdamW steps at lr 3e-5 move each weight by about 1e-4 at most
            start=reference.state_dict()["transformer.h.0.attn.c_attn.weight"].t(),
            moved=5e-4,
        )
    else:
        (root / "llama").mkdir()
        vocab = make_bpe_tokenizer(root / "llama" / "tokenizer.json")
        reference = llama_reference("gqa-llama3-tied-eps1e-5", std=0.05, vocab_size=vocab)
        (root / "text.txt").write_text(make_text(30000))
        prepare = ["--input", str(root / "text.txt"), f"--out_dir={root / 'data'}"]
        prepare += [f"--tokenizer={root / 'llama' / 'tokenizer.json'}", "--txt_separator=\\n"]
        corpus.main([*prepare, "--val_tokens=1000", "--test_tokens=0", "--workers=1"])
        run += "--block_size=40 --batch_size=4 --gradient_accumulation_steps=1 --eval_interval=4".split()
        run += "--learning_rate=1e-4 --warmup_iters=1 --lr_decay_iters=4 --min_lr=1e-5".split()
        cropped = "128 cropped to 40"
        f = SimpleNamespace(
            # the run's tokenizer is the directory's tokenizer.json (the data was prepared with it)
            tokenizer={"kind": "tokenizers", "path": str(root / "llama" / "tokenizer.json")},
            tok_spec=huggingface.llama_tokenizer(str(root / "llama")),
            pad=0,
            eos="<|end_of_text|>",
            bos="<|begin_of_text|>",
            known_ids={},
            files={"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"},
            # the scaling recorded, so resume and export keep it
            model_args=dict(n_kv_head=2, block_size=40, vocab_size=vocab, norm_eps=1e-5, rope_scaling=SCALING),
            shapes={"transformer.h.0.attn.c_attn.weight": (64 + 2 * 2 * 16, 64)},  # q, and 2 key/value heads
            # 4 AdamW steps at lr <= 1e-4 move each weight by at most ~4e-4
            start=torch.cat([reference.state_dict()[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]),
            moved=1e-3,
        )
    reference.save_pretrained(root / arch)
    result = run_script("train.py", *run, f"--init_from={root / arch}", "--max_iters=4")
    assert result.returncode == 0, result.stderr
    assert "come from the weights" in result.stdout and f"block_size {cropped}" in result.stdout
    return SimpleNamespace(arch=arch, root=root, source=root / arch, reference=reference, run=run, **vars(f))


def test_finetuning_starts_from_the_weights(finetuned):
    f = finetuned
    state = torch.load(f.root / "out" / "ckpt.pt", weights_only=True)
    assert state["iter_num"] == 4
    assert {k: state["model_args"][k] for k in f.model_args} == f.model_args
    assert {k: state["tokenizer"][k] for k in f.tokenizer} == f.tokenizer
    assert {k: tuple(state["model"][k].shape) for k in f.shapes} == f.shapes
    # the start was the directory's weights, not a fresh init (which would be ~0.05 away)
    assert 0 < max_diff(state["model"]["transformer.h.0.attn.c_attn.weight"], f.start) < f.moved


def test_sample_py_from_the_directory_is_transformers_greedy(finetuned, capsys):
    f = finetuned
    common = ["--device=cpu", f"--start={PROMPT}", "--stream=False"]
    greedy_flags = "--temperature=0 --num_samples=1 --max_new_tokens=8 --stop_at_eot=False".split()
    sample.main([f"--init_from={f.source}", *common, *greedy_flags])
    out = capsys.readouterr().out
    encode, decode = tokenizer.load(f.tok_spec)
    prompt = torch.tensor([encode(PROMPT)])
    greedy = f.reference.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=f.pad)
    expected = PROMPT + decode(greedy[0, prompt.size(1) :].tolist()) + "\n" + sample.SEPARATOR + "\n"
    assert out.split("\n", 1)[1] == expected
    # and from the finetuned run's checkpoint, decoded with the same tokenizer
    sample.main([f"--out_dir={f.root / 'out'}", *common, "--num_samples=2", "--max_new_tokens=5"])
    assert capsys.readouterr().out.count(PROMPT) == 2


def test_export_of_the_finetuned_run_loads_in_transformers(finetuned, capsys):
    f = finetuned
    hf.main([f"--out_dir={f.root / 'out'}", "--checkpoint=latest"])
    assert f"{ARCH[f.arch].hf_class}.from_pretrained" in capsys.readouterr().out
    export = f.root / "out" / "hf"
    assert {*f.files, "tokenizer_config.json"} <= {p.name for p in export.iterdir()}
    model, tok_spec = checkpoint.load_model(str(f.root / "out"), "latest")
    exported = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert type(exported).__name__ == ARCH[f.arch].hf_class
    idx = tokens(f.arch, length=model.config.block_size)
    assert max_diff(their_logits(exported, idx), our_logits(model, idx)) <= ARCH[f.arch].tol
    # its tokenizer: the same ids as the run's, and end-of-text known, as lm-evaluation-harness needs
    encode, _ = tokenizer.load(tok_spec)
    theirs = transformers.AutoTokenizer.from_pretrained(export)
    for text, ids in {"The king shall not": encode("The king shall not"), **f.known_ids}.items():
        assert theirs(text, add_special_tokens=False)["input_ids"] == encode(text) == ids
    assert theirs.eos_token == f.eos == tok_spec.get("eot", f.eos)
    assert exported.config.eos_token_id == tokenizer.eot(tok_spec) == theirs.convert_tokens_to_ids(f.eos)
    assert exported.config.bos_token_id == theirs.convert_tokens_to_ids(f.bos)


def test_a_finetuned_run_resumes_with_the_same_command(finetuned):
    # last of the finetuned run's tests: it moves the checkpoint on
    f = finetuned
    result = run_script("train.py", *f.run, "--init_from=resume", "--max_iters=6")
    assert result.returncode == 0, result.stderr
    state = torch.load(f.root / "out" / "ckpt.pt", weights_only=True)
    assert state["iter_num"] == 6 and {k: state["model_args"][k] for k in f.model_args} == f.model_args


def test_finetuning_needs_data_from_the_directorys_tokenizer(tmp_path):
    (tmp_path / "llama").mkdir()
    vocab = make_bpe_tokenizer(tmp_path / "llama" / "tokenizer.json")
    llama_reference("gqa-llama3-tied-eps1e-5", vocab_size=vocab).save_pretrained(tmp_path / "llama")
    cfg = parse(TrainConfig, [f"--init_from={tmp_path / 'llama'}", "--dataset=shakespeare"])
    with pytest.raises(UserError, match="needs data tokenized with its .*tokenizer.json.*--tokenizer="):
        load.for_training(cfg, huggingface.GPT2_TOKENIZER)
    other = tmp_path / "tokenizer.json"
    make_bpe_tokenizer(other)
    text = json.loads(other.read_text())
    text["model"]["vocab"] = {k: (v + 1) % len(text["model"]["vocab"]) for k, v in text["model"]["vocab"].items()}
    other.write_text(json.dumps(text))
    with pytest.raises(UserError, match="needs data tokenized with its"):
        load.for_training(cfg, tokenizer.make_spec(str(other)))


# ---------------------------------------------------------------------------- bad input, one line each


def test_a_directory_of_another_architecture_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    )
    result = run_script("sample.py", f"--init_from={tmp_path}", "--device=cpu")
    assert result.returncode == 2 and one_line_error(result) == (
        f"error: {tmp_path} holds a 'mistral' model; only GPT-2 and Llama (model_type 'gpt2' or 'llama') "
        "and hf.py's own export ('gpt_trainer') can be loaded"
    )


UNLOADABLE = {  # id: (the directory, its config.json's change, what the one line names)
    "no-config": ("empty", {}, "no config.json"),
    "gpt_neox": ("config", {"model_type": "gpt_neox"}, "'gpt_neox' model; only GPT-2 and Llama"),
    "gpt2-no-weights": ("config", {"model_type": "gpt2"}, "cannot load the GPT-2 model in"),
    # a GPT-2 or a Llama saved by transformers, its config.json changed, or a file of its weights removed
    "relu": ("gpt2", {"activation_function": "relu"}, "activation_function"),
    "scale_attn_by_inverse_layer_idx": (
        "gpt2",
        {"scale_attn_by_inverse_layer_idx": True},
        "scale_attn_by_inverse_layer_idx",
    ),
    "llama-no-weights": ("no-weights", {}, "has no model.safetensors nor model.safetensors.index.json"),
    "llama-missing-shard": ("no-shard-2", {}, r"model-00002-of-\d+\.safetensors is missing"),
    "intermediate_size": (
        "llama",
        {"intermediate_size": 128},
        r"model.layers.0.mlp.gate_proj.weight is \(96, 64\), but config.json makes it \(128, 64\)",
    ),
    "num_key_value_heads": (
        "llama",
        {"num_key_value_heads": 2},
        r"k_proj.weight is \(16, 64\), but config.json makes it \(32, 64\)",
    ),
    "more-layers": ("llama", {"num_hidden_layers": 3}, "has no weight model.layers.2."),
    "fewer-layers": (
        "llama",
        {"num_hidden_layers": 1},
        r"has 9 weight\(s\) this Llama has no place for \(model.layers.1.",
    ),
    # settings our GPT cannot reproduce, in Llama-3.2-1B's config.json: refused before any weights are looked for
    "biases": ("1b", dict(attention_bias=True, mlp_bias=False), "attention_bias=True but mlp_bias=False"),
    "yarn": (
        "1b",
        dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
        "rope_type='yarn'",
    ),
    "sliding_window": ("1b", dict(sliding_window=16), "sliding_window=16"),
    "gelu": ("1b", dict(hidden_act="gelu"), "hidden_act='gelu'"),
    "head_dim": ("1b", dict(head_dim=32), "head_dim=32"),
}


@pytest.mark.parametrize("directory, change, named", UNLOADABLE.values(), ids=list(UNLOADABLE))
def test_a_directory_we_cannot_load_is_one_line(tmp_path, directory, change, named):
    config = {"config": {}, "1b": LLAMA_3_2_1B}.get(directory)
    if directory in ("gpt2", "llama", "no-weights", "no-shard-2"):
        theirs = gpt2_reference() if directory == "gpt2" else llama_reference("gqa-llama3-untied-eps1e-6")
        theirs.save_pretrained(tmp_path, **({"max_shard_size": "40KB"} if directory == "no-shard-2" else {}))
        config = json.loads((tmp_path / "config.json").read_text())
    if directory == "no-weights":
        (tmp_path / "model.safetensors").unlink()
    if directory == "no-shard-2":
        next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError, match=named) as e:
        load.pretrained(str(tmp_path))
    assert "\n" not in str(e.value), str(e.value)
