"""GPT-2 weights in and out (hf.py) against transformers' own GPT2LMHeadModel, built locally
from a GPT2Config (no hub): the same logits both ways, directories both ways, finetuning
from a local GPT-2 directory end to end, and the one-line errors."""

import numpy as np
import pytest
import torch
from conftest import make_text, needs
from processes import run_python, run_script

needs("transformers")
import transformers

import hf
import sample
from configurator import TrainConfig, UserError, parse
from gpt.data import tokenizer
from gpt.outdir import checkpoint
from gpt.weights import huggingface, load
from model import GPT, GPTConfig

# GPT-2's vocab: 50257 rows padded to 50304
SMALL = dict(n_layer=2, n_head=4, n_embd=64, vocab_size=50257, n_positions=64)
TOL = 1e-5  # float32


def randomize(module, seed=0, std=0.2):
    """Every parameter random, biases and norm gains included: a weight copied to the wrong
    place, or not at all, changes the logits (at init, biases are 0 and gains 1 on both sides)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module.eval()


def tokens(B=2, T=64, vocab_size=50257):
    return torch.randint(0, vocab_size, (B, T), generator=torch.Generator().manual_seed(1))


def max_diff(a, b):
    return (a - b).abs().max().item()


@torch.no_grad()
def our_logits(model, idx):
    return model.eval()(idx, logits_at="all")[0]


@torch.no_grad()
def their_logits(hf_model, idx):
    return hf_model.eval()(idx).logits


# ---------------------------------------------------------------------------- in: transformers -> ours


@pytest.mark.parametrize(
    "options",
    [
        dict(activation_function="gelu"),  # exact GELU, our default
        dict(activation_function="gelu_new"),  # the released models' tanh approximation
        dict(
            activation_function="gelu_new", n_inner=96, tie_word_embeddings=False, layer_norm_epsilon=1e-2
        ),  # norm_eps
    ],
)
def test_import_gives_transformers_logits(options):
    reference = randomize(transformers.GPT2LMHeadModel(transformers.GPT2Config(**SMALL, **options)))
    model, model_args = huggingface.gpt_from_hf(reference)
    idx = tokens()
    assert max_diff(our_logits(model, idx), their_logits(reference, idx)) <= TOL
    # model_args rebuild the same model, as sample.py and resume do from a checkpoint
    rebuilt = GPT(GPTConfig(**model_args))
    rebuilt.load_state_dict(model.state_dict())
    assert torch.equal(our_logits(rebuilt, idx), our_logits(model, idx))
    assert model_args["mlp"] == ("gelu" if options["activation_function"] == "gelu" else "gelu_tanh")


def test_load_reads_a_directory(tmp_path):
    reference = randomize(transformers.GPT2LMHeadModel(transformers.GPT2Config(**SMALL)))
    reference.save_pretrained(tmp_path / "gpt2")
    model, tok_spec = load.pretrained(str(tmp_path / "gpt2"))
    assert isinstance(model, GPT) and tok_spec == huggingface.GPT2_TOKENIZER
    idx = tokens()
    assert max_diff(our_logits(model, idx), their_logits(reference, idx)) <= TOL


def test_import_refuses_what_our_gpt_cannot_reproduce():
    for options, named in [
        (dict(activation_function="relu"), "activation_function"),
        (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ]:
        with pytest.raises(UserError, match=named):
            huggingface.gpt_from_hf(transformers.GPT2LMHeadModel(transformers.GPT2Config(**SMALL, **options)))


def test_a_directory_without_gpt2_is_a_one_line_error(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        load.pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "gpt_neox"}')
    with pytest.raises(UserError, match="'gpt_neox' model; only GPT-2 and Llama"):
        load.pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "gpt2"}')
    with pytest.raises(UserError, match="cannot load the GPT-2 model in"):  # no weights
        load.pretrained(str(tmp_path))
    with pytest.raises(UserError, match="init_from='gpt7' is not one of"):
        parse(TrainConfig, ["--init_from=gpt7"])
    assert parse(TrainConfig, ["--init_from=gpt2-xl"]).init_from == "gpt2-xl"
    cfg = parse(TrainConfig, [f"--init_from={tmp_path}"])
    assert cfg.init_from == str(tmp_path)
    with pytest.raises(UserError, match="needs data tokenized with GPT-2's BPE"):
        load.for_training(cfg, {"kind": "char", "chars": "ab"})


@pytest.mark.process
def test_an_unreachable_hub_is_a_one_line_error(tmp_path):
    # an empty cache and no network: it must fail at once, saying what to do instead
    # isolated: huggingface_hub reads HF_HUB_OFFLINE and HF_HOME when it is imported
    result = run_script(
        "sample.py",
        "--init_from=gpt2",
        "--device=cpu",
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")},
        isolated=True,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: cannot download 'gpt2' from Hugging Face")
    assert lines[0].endswith("pass a local directory: --init_from=/path/to/gpt2")


# ---------------------------------------------------------------------------- out: ours -> transformers


@pytest.mark.parametrize(
    "options",
    [
        dict(),  # GPT-2's shape, exact GELU
        dict(mlp="gelu_tanh"),
        dict(bias=False),  # exported as zero biases, which add nothing
        dict(tie_embeddings=False, mlp_hidden=96, norm_eps=1e-2),  # as layer_norm_epsilon
        dict(vocab_size=50304),  # nanoGPT's padded vocabulary: the export keeps GPT-2's 50257 tokens
    ],
)
def test_export_loads_in_transformers_with_our_logits(tmp_path, options):
    torch.manual_seed(0)
    model = randomize(
        GPT(GPTConfig(**{**dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=50257), **options}))
    )
    idx = tokens()
    ours = our_logits(model, idx)[..., :50257]
    huggingface.export(model, huggingface.GPT2_TOKENIZER, str(tmp_path / "hf"))
    reference = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert reference.config.vocab_size == 50257
    assert max_diff(their_logits(reference, idx), ours) <= TOL
    # and back: the exported directory imports to the same model
    again, _ = huggingface.load_gpt2(str(tmp_path / "hf"))
    assert max_diff(our_logits(again, idx), ours) <= TOL


@pytest.mark.parametrize(
    "options, named",
    [
        (dict(pos_encoding="rope"), "pos_encoding='rope'"),
        (dict(norm="rmsnorm"), "norm='rmsnorm'"),
        (dict(mlp="swiglu"), "mlp='swiglu'"),
        (dict(n_kv_head=2), "n_kv_head=2"),
        (dict(qk_norm=True), "qk_norm=True"),
    ],
)
def test_models_gpt2_cannot_hold_export_as_our_own_class(options, named):
    # GPTTrainerForCausalLM, whose logits tests/test_hf_recipe.py checks
    config = GPTConfig(n_layer=1, n_head=4, n_embd=32, block_size=16, vocab_size=65, **options)
    with pytest.raises(UserError, match=named):
        huggingface.hf_config(config, 65)
    assert huggingface.export_architecture(config) == "gpt_trainer"


def test_chat_data_takes_gpt2s_padding_rows_for_its_turn_tokens(tmp_path):
    reference = randomize(transformers.GPT2LMHeadModel(transformers.GPT2Config(**SMALL)))
    reference.save_pretrained(tmp_path / "gpt2")
    cfg = parse(TrainConfig, [f"--init_from={tmp_path / 'gpt2'}", "--block_size=64", "--dropout=0.0"])
    notes = []
    turn_ids = [50257, 50258, 50259, 50260]  # what gpt/data/chat_template.py gives GPT-2
    chat_spec = {
        **huggingface.GPT2_TOKENIZER,
        "vocab_size": 50261,
        "chat": {
            "format": "role_tokens",
            "tokens": {
                "bos": {"id": 50256},
                **{n: {"id": i} for n, i in zip(("system", "user", "assistant", "end"), turn_ids)},
            },
        },
    }
    model, model_args = load.for_training(cfg, chat_spec, report=notes.append)
    assert model.config.vocab_size == model_args["vocab_size"] == 50261 and model.config.padded_vocab_size == 50304
    wte = model.transformer.wte.weight
    mean = wte[:50257].mean(dim=0)
    assert all(torch.equal(wte[i], mean) for i in turn_ids) and not wte[50261:].any()
    idx = tokens()
    # GPT-2's tokens unchanged
    assert max_diff(our_logits(model, idx)[..., :50257], their_logits(reference, idx)) <= TOL
    assert any("the chat template's turn tokens 50257, 50258, 50259, 50260 start as the mean" in n for n in notes)
    # without chat data (or past the padding) a larger tokenizer is still refused
    with pytest.raises(UserError, match="more than the vocab_size=50257"):
        load.for_training(cfg, {**huggingface.GPT2_TOKENIZER, "vocab_size": 50261}, report=notes.append)
    far = {**chat_spec, "vocab_size": 50400, "chat": {"format": "role_tokens", "tokens": {"end": {"id": 50399}}}}
    with pytest.raises(UserError, match="more than the vocab_size=50257"):
        load.for_training(cfg, far, report=notes.append)


# ---------------------------------------------------------------------------- finetuning end to end


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    """A small GPT-2 directory (as transformers writes it), GPT-2 BPE data, and a run of
    config/finetune_shakespeare.py from that directory."""
    root = tmp_path_factory.mktemp("hf")
    reference = randomize(transformers.GPT2LMHeadModel(transformers.GPT2Config(**SMALL)), std=0.05)
    reference.save_pretrained(root / "gpt2")
    encode, _ = tokenizer.load(huggingface.GPT2_TOKENIZER)
    ids = np.array(encode(make_text(20000)), dtype=np.uint16)  # headerless uint16, as prepare.py writes
    (root / "data").mkdir()
    ids[: len(ids) * 9 // 10].tofile(root / "data" / "train.bin")
    ids[len(ids) * 9 // 10 :].tofile(root / "data" / "val.bin")
    run = [
        "config/finetune_shakespeare.py",
        f"--dataset={root / 'data'}",
        f"--out_dir={root / 'out'}",
        "--device=cpu",
        "--compile=False",
        "--block_size=32",
        "--gradient_accumulation_steps=2",
        "--eval_iters=2",
        "--eval_interval=2",
    ]
    result = run_script("train.py", *run, f"--init_from={root / 'gpt2'}", "--max_iters=4")
    assert result.returncode == 0, result.stderr
    assert "come from the weights" in result.stdout and "block_size 64 cropped to 32" in result.stdout
    return root, reference, run


def test_finetuning_starts_from_the_gpt2_weights(finetuned):
    root, reference, _ = finetuned
    state = torch.load(root / "out" / "ckpt.pt", weights_only=True)
    assert state["iter_num"] == 4
    assert {
        k: state["model_args"][k] for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias", "mlp")
    } == dict(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=50257, bias=True, mlp="gelu_tanh")
    # 4 AdamW steps at lr 3e-5 move each weight by about 1e-4 at most: the start was GPT-2's
    # weights, not a fresh init (which would be ~0.05 away)
    start = reference.state_dict()["transformer.h.0.attn.c_attn.weight"].t()
    now = state["model"]["transformer.h.0.attn.c_attn.weight"]
    assert 0 < max_diff(now, start) < 5e-4
    assert state["model"]["transformer.wpe.weight"].shape == (32, 64)  # cropped from 64 positions


def test_a_finetuned_run_resumes_with_the_same_command(finetuned):
    root, _, run = finetuned
    result = run_script("train.py", *run, "--init_from=resume", "--max_iters=6")
    assert result.returncode == 0, result.stderr
    assert torch.load(root / "out" / "ckpt.pt", weights_only=True)["iter_num"] == 6


def test_export_of_the_finetuned_checkpoint_matches_it(finetuned, capsys):
    root, _, _ = finetuned
    hf.main([f"--out_dir={root / 'out'}", "--checkpoint=latest", f"--export_dir={root / 'export'}"])
    model, _ = checkpoint.load_model(str(root / "out"), "latest")
    exported = transformers.GPT2LMHeadModel.from_pretrained(root / "export")
    idx = tokens(T=32)
    assert max_diff(their_logits(exported, idx), our_logits(model, idx)) <= TOL
    # GPT-2's tokenizer is there too, with GPT-2's ids
    assert transformers.GPT2Tokenizer.from_pretrained(root / "export").encode("Hello world") == [15496, 995]


def test_sample_py_from_a_gpt2_directory_is_transformers_greedy(finetuned, capsys):
    root, reference, _ = finetuned
    sample.main(
        [
            f"--init_from={root / 'gpt2'}",
            "--device=cpu",
            "--temperature=0",
            "--num_samples=1",
            "--max_new_tokens=8",
            "--start=ROMEO:",
            "--stream=False",
            "--stop_at_eot=False",
        ]
    )
    out = capsys.readouterr().out
    encode, decode = tokenizer.load(huggingface.GPT2_TOKENIZER)
    prompt = torch.tensor([encode("ROMEO:")])
    greedy = reference.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=50256)
    assert (
        out.split("\n", 1)[1]
        == "ROMEO:" + decode(greedy[0, prompt.size(1) :].tolist()) + "\n" + sample.SEPARATOR + "\n"
    )
    # and from the finetuned run's checkpoint
    sample.main(
        [
            f"--out_dir={root / 'out'}",
            "--device=cpu",
            "--num_samples=2",
            "--max_new_tokens=5",
            "--start=ROMEO:",
            "--stream=False",
        ]
    )
    assert capsys.readouterr().out.count("ROMEO:") == 2


@pytest.mark.process
def test_nanogpt_from_pretrained_gives_transformers_logits(tmp_path):
    # nanoGPT's own line, `GPT.from_pretrained("gpt2", dict(dropout=0.0))`, offline: a tiny random
    # GPT-2 saved into a Hugging Face cache under the released name, read with the hub switched off
    snapshot = tmp_path / "hub" / "models--gpt2" / "snapshots" / ("0" * 40)
    randomize(
        transformers.GPT2LMHeadModel(transformers.GPT2Config(**SMALL, activation_function="gelu_new"))
    ).save_pretrained(snapshot)
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
    assert float(result.stdout.strip().splitlines()[-1]) <= TOL
