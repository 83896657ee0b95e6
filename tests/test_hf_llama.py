"""Llama weights in and out (hf.py) against transformers' own LlamaForCausalLM, built locally
from a LlamaConfig (no hub): RoPE and Llama 3's frequency scaling against transformers' rotary
code, the same logits both ways (GQA, llama3 scaling, tied and untied, rms eps 1e-5 and 1e-6,
biases), sharded safetensors, Llama-3.2-1B's published config.json, a finetune from a local
directory with its own tokenizer.json end to end, and the one-line errors."""

import copy
import dataclasses
import json

import pytest
import torch
from conftest import make_text, needs
from processes import run_script

needs("transformers")
import transformers
from test_hf import max_diff, our_logits, randomize, their_logits

import hf
import sample
import train
from configurator import TrainConfig, UserError, parse
from data import corpus
from gpt.data import tokenizer
from gpt.outdir import checkpoint
from gpt.outdir.checkpoint import check_resumable
from gpt.train.build import make_model_args
from gpt.weights import huggingface, load
from model import GPT, GPTConfig, apply_rope, rope_tables

TOL = 1e-4  # float32
V = 96
TINY = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    rope_theta=10000.0,
)
# with head size 16 and theta 1e4 over a 32-token original context, pair 0 turns ~5 times (kept),
# pair 1 ~1.6 times (smoothed) and the rest less than once (slowed 8x): every branch of the scaling
LLAMA3 = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
)
T = 48  # longer than LLAMA3's original context

CASES = {
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
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}


def llama_config(case, **overrides):
    # a copy: transformers adds rope_theta to the rope_scaling dict it is given
    return transformers.LlamaConfig(**copy.deepcopy({**TINY, **CASES[case], **overrides}))


def reference(case, seed=0, std=0.2, **overrides):
    """A LlamaForCausalLM with every parameter random (norm gains and biases too, so a weight
    copied to the wrong place, or not at all, changes the logits)."""
    return randomize(transformers.LlamaForCausalLM(llama_config(case, **overrides)), seed, std)


def with_tokenizer(directory):
    """directory, given a tokenizer.json of its own as every Llama directory has (load.pretrained
    reads it beside the weights): two tokens, end-of-text one of them."""
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"<|end_of_text|>": 0, "<unk>": 1}, unk_token="<unk>"))
    tok.save(str(directory / "tokenizer.json"))
    return directory


def tokens(B=2, length=T):
    return torch.randint(0, V, (B, length), generator=torch.Generator().manual_seed(1))


# ---------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["plain", "llama3"])
def test_rope_is_transformers_rotation(scaling):
    """model.rope_tables and apply_rope against LlamaRotaryEmbedding and apply_rotary_pos_emb:
    the same angles (Llama 3's scaling included), and the same half-split layout, pairing
    dims (i, i + hs/2), so q and k rows are copied without a permutation."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = transformers.LlamaConfig(**TINY, rope_scaling=copy.deepcopy(scaling))
    hs = 16
    q, k = torch.randn(2, 4, T, hs), torch.randn(2, 2, T, hs)
    cos, sin = LlamaRotaryEmbedding(config)(q, torch.arange(T)[None])  # (1, T, hs): each angle twice
    ours_cos, ours_sin = rope_tables(
        hs, T, 10000.0, None if scaling is None else {k: v for k, v in scaling.items() if k != "rope_type"}
    )
    torch.testing.assert_close(torch.cat([ours_cos, ours_cos], -1), cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat([ours_sin, ours_sin], -1), sin[0], atol=1e-6, rtol=0)
    their_q, their_k = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(apply_rope(q, ours_cos, ours_sin), their_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(apply_rope(k, ours_cos, ours_sin), their_k, atol=1e-6, rtol=0)
    if scaling is not None:  # and the scaling does something at these sizes
        assert max_diff(ours_cos, rope_tables(hs, T, 10000.0)[0]) > 0.1


# ---------------------------------------------------------------------------- in: transformers -> ours


@pytest.mark.parametrize("case", CASES)
def test_import_gives_transformers_logits(tmp_path, case):
    theirs = reference(case)
    theirs.save_pretrained(tmp_path / "llama")
    model, _ = load.pretrained(str(with_tokenizer(tmp_path / "llama")))
    idx = tokens()
    assert max_diff(our_logits(model, idx), their_logits(theirs, idx)) <= TOL
    c = theirs.config
    ours = (model.config.n_kv_head, model.config.norm_eps, model.config.tie_embeddings, model.config.bias)
    assert ours == (c.num_key_value_heads, c.rms_norm_eps, c.tie_word_embeddings, c.attention_bias)
    assert (model.transformer.wte.weight is model.lm_head.weight) == c.tie_word_embeddings


def test_sharded_safetensors_import(tmp_path):
    theirs = reference("gqa-llama3-untied-eps1e-6")
    theirs.save_pretrained(tmp_path / "llama", max_shard_size="40KB")
    assert len(list((tmp_path / "llama").glob("model-*-of-*.safetensors"))) > 2
    assert (tmp_path / "llama" / "model.safetensors.index.json").exists()
    model, model_args = huggingface.load_llama(str(tmp_path / "llama"))
    idx = tokens()
    assert max_diff(our_logits(model, idx), their_logits(theirs, idx)) <= TOL
    # the scaling is a model key: model_args, as a checkpoint records them, rebuild the same model
    assert model_args["rope_scaling"] == {k: v for k, v in LLAMA3.items() if k != "rope_type"}
    rebuilt = GPT(GPTConfig(**model_args))
    rebuilt.load_state_dict(model.state_dict())
    assert torch.equal(our_logits(rebuilt, idx), our_logits(model, idx))


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
    assert c.rope_scaling == {
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


# ---------------------------------------------------------------------------- out: ours -> transformers


@pytest.mark.parametrize("case", CASES)
def test_export_loads_in_transformers_with_our_logits(tmp_path, case):
    model = GPT(GPTConfig(**huggingface.llama_model_args(llama_config(case).to_dict())))
    torch.manual_seed(0)
    with torch.no_grad():  # every weight random, norm gains and biases too
        for p in model.parameters():
            p.normal_(0, 0.2)
    idx = tokens()
    ours = our_logits(model, idx)
    assert huggingface.export(model, {"kind": "char", "chars": "x" * V}, str(tmp_path / "hf")) == "llama"
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    assert max_diff(their_logits(exported, idx), ours) <= TOL
    assert exported.config.num_key_value_heads == model.config.n_kv_head
    assert exported.config.rms_norm_eps == model.config.norm_eps
    # and back: the exported directory imports to the same model
    again, _ = huggingface.load_llama(str(tmp_path / "hf"))
    assert max_diff(our_logits(again, idx), ours) <= TOL


# ---------------------------------------------------------------------------- finetuning end to end


def make_bpe_tokenizer(path):
    """A small byte-level BPE tokenizer.json, trained here, with Llama 3's two special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """A tiny Llama directory (as transformers writes it) with its own tokenizer.json, data
    prepared with that tokenizer, and 4 steps of finetuning from the directory."""
    root = tmp_path_factory.mktemp("llama")
    (root / "llama").mkdir()
    vocab = make_bpe_tokenizer(root / "llama" / "tokenizer.json")
    theirs = reference("gqa-llama3-tied-eps1e-5", std=0.05, vocab_size=vocab)
    theirs.save_pretrained(root / "llama")
    (root / "text.txt").write_text(make_text(30000))
    corpus.main(
        [
            "--input",
            str(root / "text.txt"),
            f"--out_dir={root / 'data'}",
            f"--tokenizer={root / 'llama' / 'tokenizer.json'}",
            "--txt_separator=\\n",
            "--val_tokens=1000",
            "--test_tokens=0",
            "--workers=1",
        ]
    )
    run = [
        f"--dataset={root / 'data'}",
        f"--out_dir={root / 'out'}",
        "--device=cpu",
        "--compile=False",
        "--block_size=40",
        "--batch_size=4",
        "--gradient_accumulation_steps=1",
        "--eval_iters=2",
        "--eval_interval=4",
        "--learning_rate=1e-4",
        "--warmup_iters=1",
        "--lr_decay_iters=4",
        "--min_lr=1e-5",
        "--max_iters=4",
    ]
    assert train.main([*run, f"--init_from={root / 'llama'}"]) == 0
    return root, theirs, vocab, run


def test_finetuning_starts_from_the_llama_weights(finetuned):
    root, theirs, vocab, _ = finetuned
    state = torch.load(root / "out" / "ckpt.pt", weights_only=True)
    assert state["iter_num"] == 4
    args = state["model_args"]
    assert (args["n_kv_head"], args["block_size"], args["vocab_size"], args["norm_eps"]) == (2, 40, vocab, 1e-5)
    assert args["rope_scaling"]["original_max_position_embeddings"] == 32  # recorded, so resume and export keep it
    # the run's tokenizer is the directory's tokenizer.json (the data was prepared with it)
    assert state["tokenizer"]["kind"] == "tokenizers" and state["tokenizer"]["path"] == str(
        root / "llama" / "tokenizer.json"
    )
    # 4 AdamW steps at lr <= 1e-4 move each weight by at most ~4e-4: the start was the Llama's
    # weights, not a fresh init (~0.05 away)
    start = torch.cat([theirs.state_dict()[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert 0 < max_diff(state["model"]["transformer.h.0.attn.c_attn.weight"], start) < 1e-3


def test_sample_py_from_the_llama_directory_is_transformers_greedy(finetuned, capsys):
    root, theirs, _, _ = finetuned
    sample.main(
        [
            f"--init_from={root / 'llama'}",
            "--device=cpu",
            "--temperature=0",
            "--num_samples=1",
            "--max_new_tokens=8",
            "--start=The king",
            "--stream=False",
            "--stop_at_eot=False",
        ]
    )
    out = capsys.readouterr().out
    encode, decode = tokenizer.load(huggingface.llama_tokenizer(str(root / "llama")))
    prompt = torch.tensor([encode("The king")])
    greedy = theirs.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert (
        out.split("\n", 1)[1]
        == "The king" + decode(greedy[0, prompt.size(1) :].tolist()) + "\n" + sample.SEPARATOR + "\n"
    )
    # and from the finetuned run's checkpoint, decoded with the same tokenizer
    sample.main(
        [
            f"--out_dir={root / 'out'}",
            "--device=cpu",
            "--num_samples=2",
            "--max_new_tokens=5",
            "--start=The king",
            "--stream=False",
        ]
    )
    assert capsys.readouterr().out.count("The king") == 2


def test_export_of_the_finetuned_run_loads_in_transformers(finetuned, capsys):
    root, _, _, _ = finetuned
    hf.main([f"--out_dir={root / 'out'}", "--checkpoint=latest"])
    assert "LlamaForCausalLM.from_pretrained" in capsys.readouterr().out
    export = root / "out" / "hf"
    assert {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    } <= {p.name for p in export.iterdir()}
    model, tok_spec = checkpoint.load_model(str(root / "out"), "latest")
    exported = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert isinstance(exported, transformers.LlamaForCausalLM)
    idx = tokens(length=40)
    assert max_diff(their_logits(exported, idx), our_logits(model, idx)) <= TOL
    # its tokenizer: the same ids as the run's, and end-of-text known, as lm-evaluation-harness needs
    encode, _ = tokenizer.load(tok_spec)
    theirs = transformers.AutoTokenizer.from_pretrained(export)
    assert theirs("The king shall not", add_special_tokens=False)["input_ids"] == encode("The king shall not")
    assert theirs.eos_token == "<|end_of_text|>" == tok_spec["eot"]
    assert exported.config.eos_token_id == tokenizer.eot(tok_spec)
    assert exported.config.bos_token_id == theirs.convert_tokens_to_ids("<|begin_of_text|>")


def test_a_finetuned_llama_run_resumes_with_the_same_command(finetuned):
    root, _, _, run = finetuned
    assert train.main([*run, "--init_from=resume", "--max_iters=6"]) == 0
    state = torch.load(root / "out" / "ckpt.pt", weights_only=True)
    assert state["iter_num"] == 6 and state["model_args"]["rope_scaling"]["factor"] == 8.0


def test_finetuning_needs_data_from_the_directorys_tokenizer(finetuned, tmp_path):
    root, _, _, _ = finetuned
    cfg = parse(TrainConfig, [f"--init_from={root / 'llama'}", "--dataset=shakespeare"])
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


def assert_one_line(error):
    assert "\n" not in str(error.value), str(error.value)


def test_a_directory_of_another_architecture_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    )
    result = run_script("sample.py", f"--init_from={tmp_path}", "--device=cpu")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: {tmp_path} holds a 'mistral' model; only GPT-2 and Llama (model_type 'gpt2' or 'llama') "
        "and hf.py's own export ('gpt_trainer') can be loaded"
    ]


def test_missing_weights_are_one_line(tmp_path):
    theirs = reference("gqa-llama3-untied-eps1e-6")
    theirs.save_pretrained(tmp_path / "whole")
    (tmp_path / "whole" / "model.safetensors").unlink()
    with pytest.raises(UserError, match="has no model.safetensors nor model.safetensors.index.json") as e:
        load.pretrained(str(tmp_path / "whole"))
    assert_one_line(e)
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    next((tmp_path / "sharded").glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(UserError, match=r"model-00002-of-\d+\.safetensors is missing") as e:
        load.pretrained(str(tmp_path / "sharded"))
    assert_one_line(e)


def test_weights_that_disagree_with_config_json_are_one_line(tmp_path):
    reference("gqa-llama3-untied-eps1e-6").save_pretrained(tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    for key, value, named in [
        (
            "intermediate_size",
            128,
            r"model.layers.0.mlp.gate_proj.weight is \(96, 64\), "
            r"but config.json makes it \(128, 64\)",
        ),
        ("num_key_value_heads", 2, r"k_proj.weight is \(16, 64\), but config.json makes it \(32, 64\)"),
        ("num_hidden_layers", 3, "has no weight model.layers.2."),
        ("num_hidden_layers", 1, r"has 9 weight\(s\) this Llama has no place for \(model.layers.1."),
    ]:
        (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(UserError, match=named) as e:
            load.pretrained(str(tmp_path / "llama"))
        assert_one_line(e)


@pytest.mark.parametrize(
    "setting, named",
    [
        (dict(attention_bias=True, mlp_bias=False), "attention_bias=True but mlp_bias=False"),
        (
            dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32)),
            "rope_type='yarn'",
        ),
        (dict(sliding_window=16), "sliding_window=16"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(head_dim=32), "head_dim=32"),
    ],
)
def test_settings_our_gpt_cannot_reproduce_are_refused(tmp_path, setting, named):
    config = {**LLAMA_3_2_1B, **setting}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=named) as e:
        load.pretrained(str(tmp_path))  # refused before any weights are looked for
    assert_one_line(e)


@pytest.mark.parametrize(
    "options", [dict(norm="rmsnorm"), dict(pos_encoding="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True)]
)
def test_models_neither_class_computes_export_as_our_own(options):
    # GPTTrainerForCausalLM, whose logits tests/test_hf_recipe.py checks; a Llama is still a Llama
    config = GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=16, vocab_size=65, **options)
    assert huggingface.export_architecture(config) == "gpt_trainer"
    llama = dataclasses.replace(config, pos_encoding="rope", norm="rmsnorm", mlp="swiglu", qk_norm=False)
    assert huggingface.export_architecture(llama) == "llama"


def test_rope_scaling_key_is_validated():
    good = {k: v for k, v in LLAMA3.items() if k != "rope_type"}
    cfg = parse(TrainConfig, ["--pos_encoding=rope", f"--rope_scaling={good}", "--norm_eps=1e-6"])
    assert make_model_args(cfg, 65)["rope_scaling"] == good and make_model_args(cfg, 65)["norm_eps"] == 1e-6
    for argv, named in [
        ([f"--rope_scaling={good}"], "needs pos_encoding='rope'"),
        (["--pos_encoding=rope", "--rope_scaling={'factor': 8.0}"], "must have exactly the numbers"),
        (["--pos_encoding=rope", f"--rope_scaling={ {**good, 'low_freq_factor': 5.0} }"], "low_freq_factor < high"),
        (["--norm_eps=0"], "norm_eps=0"),
    ]:
        with pytest.raises(UserError, match=named):
            parse(TrainConfig, argv)
    # a changed scaling is another model: resume refuses it
    args = make_model_args(cfg, 65)
    with pytest.raises(UserError, match="rope_scaling"):
        check_resumable(args, {**args, "rope_scaling": {**good, "factor": 4.0}})
    with pytest.raises(UserError, match="norm_eps"):
        check_resumable(args, {**args, "norm_eps": 1e-5})
    assert dataclasses.asdict(GPTConfig())["rope_scaling"] is None
