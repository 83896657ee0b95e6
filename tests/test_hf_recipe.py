"""hf.py's export of what neither Hugging Face's GPT-2 nor its Llama computes (the speedrun recipe's
architecture): GPTTrainerForCausalLM, gpt/weights/modeling_gpt_trainer.py copied beside the weights
for trust_remote_code=True. Our logits, sample.py's greedy tokens, a chat template, GGUF refused in one
line. Other mixes of the options: test_hf.py's test_export_logits_match_transformers[gpt_trainer-*]."""

import dataclasses
import json

import pytest
import torch
from conftest import char_dataset, needs, save_chat_checkpoint, tiny_args
from processes import REPO

needs("transformers")
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf
import sample
import train
from configurator import TrainConfig, UserError, parse
from gpt.data import tokenizer
from gpt.data.chat_template import Template
from gpt.outdir import checkpoint
from gpt.weights import huggingface, load
from model import GPT, GPTConfig

# config/train_shakespeare_char_cpu.py's architecture keys
RECIPE = dict(bias=False, pos_encoding="rope", norm="rmsnorm", qk_norm=True, mlp="relu2", tie_embeddings=False)
RECIPE.update(zero_init_proj=True, logit_softcap=15.0, value_embeds=True, unet_skips=True)
TOL = 1e-5  # float32


def transformers_model(export_dir):
    return AutoModelForCausalLM.from_pretrained(str(export_dir), trust_remote_code=True).eval()


def max_diff(ours, export_dir, idx):
    with torch.no_grad():
        return (ours.eval()(idx, logits_at="all")[0] - transformers_model(export_dir)(idx).logits).abs().max().item()


@pytest.fixture(scope="module")
def recipe_run(tmp_path_factory):
    """The recipe's architecture trained 6 Muon steps, then exported. 3 layers: a U-net skip (0 -> 2)
    around a block without one, value embeddings in layers 0 and 2; 2 key/value heads for 4 queries."""
    root = tmp_path_factory.mktemp("recipe")
    args = tiny_args(char_dataset(root / "chars"), root / "out", n_layer=3, n_head=4, n_kv_head=2, block_size=64)
    assert train.main([*args, *(f"--{k}={v}" for k, v in RECIPE.items()), "--optimizer=muon", "--max_iters=6"]) == 0
    hf.main([f"--out_dir={root / 'out'}"])
    return root / "out"


def test_the_export_is_our_model_class_with_our_logits(recipe_run):
    export_dir = recipe_run / "hf"
    config = json.loads((export_dir / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_gpt_trainer.GPTTrainerForCausalLM"
    # the file transformers runs is the library's own, copied as it is
    assert (export_dir / "modeling_gpt_trainer.py").read_text() == (
        REPO / "gpt/weights/modeling_gpt_trainer.py"
    ).read_text()
    model, _ = checkpoint.load_model(str(recipe_run), "best")
    assert type(transformers_model(export_dir)).__name__ == "GPTTrainerForCausalLM"
    idx = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    assert max_diff(model, export_dir, idx) <= TOL


def test_greedy_generate_gives_sample_pys_tokens(recipe_run, capsys):
    prompt, new = "The king", 40  # 48 positions: within block_size=64, which the export refuses to pass
    sample.main(
        [f"--out_dir={recipe_run}", "--device=cpu", "--temperature=0", "--num_samples=1"]
        + [f"--max_new_tokens={new}", f"--start={prompt}", "--stream=False"]
    )
    ours = capsys.readouterr().out.split("\n", 1)[1].split("\n" + sample.SEPARATOR)[0]
    # the character vocabulary goes out as a tokenizer.json that AutoTokenizer reads
    tok = AutoTokenizer.from_pretrained(str(recipe_run / "hf"), trust_remote_code=True)
    ids = torch.tensor([tok.encode(prompt)])
    model = transformers_model(recipe_run / "hf")
    cached = model.generate(ids, max_new_tokens=new, do_sample=False)
    whole = model.generate(ids, max_new_tokens=new, do_sample=False, use_cache=False)
    assert torch.equal(cached, whole)
    assert tok.decode(cached[0].tolist()) == ours and len(set(ours[len(prompt) :])) > 1
    with pytest.raises(ValueError, match="past this model's block_size=64"):
        model.generate(ids, max_new_tokens=64, do_sample=False)


def test_a_chat_model_carries_its_template(tmp_path):
    spec = tokenizer.make_spec("gpt2")
    template = Template(spec)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=template.vocab_size, **RECIPE))
    out_dir = save_chat_checkpoint(tmp_path / "out", model, spec)
    hf.main([f"--out_dir={out_dir}"])
    tok = AutoTokenizer.from_pretrained(str(out_dir / "hf"), trust_remote_code=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi, I'm Zuvaki."}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == template.render(messages, add_generation_prompt=True)[0]
    theirs = transformers_model(out_dir / "hf")
    assert theirs.generation_config.eos_token_id == template.end_id == tok.eos_token_id
    assert max_diff(model, out_dir / "hf", torch.tensor([ids])) <= TOL


def test_gguf_refuses_the_recipe_in_one_line_naming_a_config_it_takes(recipe_run):
    with pytest.raises(UserError) as e:
        hf.main([f"--out_dir={recipe_run}", "--format=gguf"])
    message = str(e.value)
    assert "\n" not in message and "cannot be exported to GGUF" in message and "mlp='relu2'" in message
    assert "export it to Hugging Face instead" in message
    assert "config/train_llama_tiny.py --dataset=shakespeare" in message
    assert not (recipe_run / "model.gguf").exists()


def test_the_export_reads_back_as_a_source(recipe_run, capsys):
    """sample.py --init_from=<the export> samples what the run does; train.py starts from it on data
    in its characters, and refuses data in other tokens."""
    common = ["--device=cpu", "--temperature=0", "--num_samples=1", "--max_new_tokens=30", "--stream=False"]
    sample.main([f"--out_dir={recipe_run}", *common])
    from_run = capsys.readouterr().out.split("\n", 1)[1]
    sample.main([f"--init_from={recipe_run / 'hf'}", *common])
    assert capsys.readouterr().out.split("\n", 1)[1] == from_run
    model, _ = checkpoint.load_model(str(recipe_run), "best")
    again, model_args, arch = huggingface.load(str(recipe_run / "hf"))
    # zero_init_proj is only how training started: the export does not keep it
    assert arch == "gpt_trainer" and model_args == {**dataclasses.asdict(model.config), "zero_init_proj": False}
    # every weight as trained, but the padding rows past vocab_size (never sampled), which come back as zeros
    V = model.config.vocab_size
    assert all(torch.equal(t[:V], model.state_dict()[k][:V]) for k, t in again.state_dict().items())
    chars = recipe_run.parent / "chars"
    cfg = parse(TrainConfig, [f"--init_from={recipe_run / 'hf'}", f"--dataset={chars}", "--block_size=64"])
    started, _ = load.for_training(cfg, tokenizer.describe(str(chars)), report=lambda line: None)
    assert all(torch.equal(t, again.state_dict()[k]) for k, t in started.state_dict().items())
    with pytest.raises(UserError, match="needs data tokenized with the tokenizer hf.py wrote beside it"):
        load.for_training(cfg, tokenizer.make_spec("gpt2"))
