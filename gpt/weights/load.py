"""Any source -> a GPT: the one place that knows where weights come from. Every command that
reads a model calls it: sample.py, chat.py, serve.py, eval.py and hf.py for inference, train.py
to start from weights trained elsewhere.

    from gpt.weights import load
    model, tok_spec = load.for_inference("resume", "out-shakespeare")     # the run's best checkpoint
    model, tok_spec = load.for_inference("resume", "out", which="latest") # its newest one
    model, tok_spec = load.for_inference("gpt2", None)                    # released GPT-2 124M
    model, tok_spec = load.for_inference("/path/to/Llama-3.2-1B", None)   # a Hugging Face directory
    model, tok_spec = load.for_inference("out-shakespeare", None)         # another run's out_dir
    model, model_args = load.for_training(cfg, data_tok_spec)             # train.py's init_from=<not scratch/resume>

The sources: a training run's checkpoint (init_from='resume' with out_dir, or init_from naming
a run's out_dir; either format, gpt/outdir/checkpoint.py reads it), a released GPT-2 name or a local
GPT-2 or Llama directory, or hf.py's export of any other model (gpt/weights/huggingface.py reads those).
Models come back in float32 on the CPU; lines about what was read go to report.
"""

import contextlib
import dataclasses
import filecmp
import io
import json
import os

from configurator import UserError
from gpt.data import tokenizer
from gpt.data.chat_template import Template
from gpt.outdir import checkpoint
from gpt.weights import huggingface
from model import GPT, GPTConfig


def for_inference(init_from, out_dir, which="best", report=print):
    """(model, tokenizer description) for sampling, chatting, serving, evaluating or exporting:
    init_from='resume' reads out_dir's checkpoint (best or latest, by which; on the CPU: the
    file's optimizer state is never used), a run's out_dir in init_from reads that run's, and
    anything else is a released GPT-2 name or a Hugging Face directory."""
    if init_from == "resume":
        return checkpoint.load_model(out_dir, which, report=report)
    if checkpoint.holds_checkpoint(init_from):
        return checkpoint.load_model(init_from, which, report=report)
    return pretrained(init_from, report)


def chat_template(vocab_size, tok_spec, init_from, out_dir):
    """The chat Template the model was trained with; UserError (saying to fine-tune first) when it
    has none. A run's checkpoint records its template; a Hugging Face directory has one when its
    tokenizer has the turn tokens and the model rows for them."""
    run = out_dir if init_from == "resume" else init_from if checkpoint.holds_checkpoint(init_from) else None
    if run and "chat" not in tok_spec:
        raise UserError(
            f"the model in {run} was not trained on conversations (its tokenizer has no chat "
            f"template): fine-tune it on chat data first (python data/chat/prepare.py, then train.py "
            f"--init_from=... --dataset=<that directory>)"
        )
    if tok_spec["kind"] == "tokenizers" and not os.path.isfile(tok_spec["path"]):
        raise UserError(f"the model's tokenizer {tok_spec['path']} is missing; restore it there")
    template = Template(tok_spec)
    if template.vocab_size > vocab_size:
        raise UserError(
            f"{init_from} has no chat tokens (the template needs {template.vocab_size} tokens, the "
            f"model has {vocab_size}): fine-tune it on chat data first (python data/chat/prepare.py)"
        )
    return template


def pretrained(name_or_path, report=print):
    """(model, tokenizer description): released GPT-2 weights or a local Hugging Face directory,
    with its tokenizer (a Llama's tokenizer.json)."""
    with contextlib.redirect_stdout(io.StringIO()) as said:  # transformers' own lines, as report's
        model, _, arch = huggingface.load(name_or_path)
    for line in said.getvalue().splitlines():
        report(line)
    if arch == "llama":
        tok_spec = huggingface.llama_tokenizer(name_or_path)
    elif arch == "gpt_trainer":
        tok_spec = _exported_tokenizer(name_or_path)
    elif model.config.vocab_size < huggingface.GPT2_VOCAB:
        raise UserError(
            f"{name_or_path} has {model.config.vocab_size} tokens, not GPT-2's {huggingface.GPT2_VOCAB}: its "
            f"tokenizer is unknown here; sample from its training run with --out_dir"
        )
    else:
        tok_spec = huggingface.GPT2_TOKENIZER
    if tokenizer.vocab_size(tok_spec) > model.config.vocab_size:
        raise UserError(
            f"{name_or_path}'s tokenizer has {tokenizer.vocab_size(tok_spec)} tokens, more than the "
            f"model's vocab_size={model.config.vocab_size}"
        )
    report(f"loaded {name_or_path} ({model.num_params(non_embedding=False) / 1e6:.1f}M parameters)")
    return model, tok_spec


def _exported_tokenizer(path):
    """The tokenizer description of what hf.py wrote beside a model: a character vocabulary (its
    one-piece-per-character tokenizer.json), GPT-2's BPE (vocab.json) or a tokenizer.json."""
    tok_path = os.path.join(path, "tokenizer.json")
    if os.path.isfile(os.path.join(path, "vocab.json")):
        return huggingface.GPT2_TOKENIZER
    if not os.path.isfile(tok_path):
        raise UserError(f"{path} has no tokenizer.json nor vocab.json; export the run again with hf.py")
    with open(tok_path, encoding="utf-8") as f:
        model = json.load(f)["model"]
    if model["type"] == "WordLevel" and all(len(piece) == 1 for piece in model["vocab"]):
        return {"kind": "char", "chars": "".join(sorted(model["vocab"], key=model["vocab"].get))}
    return tokenizer.make_spec(tok_path)


def for_training(cfg, tok_spec, report=print):
    """train.py's start from weights trained elsewhere -> (model, model_args): cfg.init_from a
    GPT-2 name, a GPT-2 or Llama directory, or another run's out_dir (its best checkpoint: e.g.
    fine-tuning on conversations after pretraining here). The weights fix the model's shape: the
    config's model keys give way, except dropout, and block_size, to which the model is cropped.
    The data must be tokenized as the weights were: a Llama's with its own tokenizer.json, a run's
    with that run's tokenizer. Chat data's turn tokens that the weights never saw start as the
    mean of the trained embeddings."""
    if checkpoint.holds_checkpoint(cfg.init_from):
        model, model_args, source_spec = _load_run(cfg, tok_spec, report)
    else:
        arch = huggingface.architecture(cfg.init_from)
        if arch == "gpt2" and not huggingface.is_gpt2_bpe(tok_spec):
            raise UserError(
                f"init_from={cfg.init_from!r} needs data tokenized with GPT-2's BPE, but {cfg.dataset}'s tokenizer "
                f"is {tok_spec['kind']}; use GPT-2 BPE data, e.g. python data/shakespeare/prepare.py"
            )
        if arch == "llama":
            theirs = huggingface.llama_tokenizer(cfg.init_from)["path"]
            if tok_spec["kind"] != "tokenizers" or not _same_contents(tok_spec["path"], theirs):
                raise UserError(
                    f"init_from={cfg.init_from!r} needs data tokenized with its {theirs}, but {cfg.dataset} was "
                    f"prepared with {_used(tok_spec)}; prepare it again with --tokenizer={theirs}"
                )
        if arch == "gpt_trainer" and not _same_vocabulary(_exported_tokenizer(cfg.init_from), tok_spec):
            raise UserError(
                f"init_from={cfg.init_from!r} needs data tokenized with the tokenizer hf.py wrote beside it, but "
                f"{cfg.dataset} was prepared with {_used(tok_spec)}; prepare it again with that tokenizer"
            )
        model, model_args, _ = huggingface.load(cfg.init_from, cfg.dropout)
        source_spec = {}
    turn_ids = _untrained_turn_tokens(tok_spec, source_spec)
    if turn_ids and max(turn_ids) < model.config.padded_vocab_size:
        report(
            f"init_from={cfg.init_from}: the chat template's turn tokens {', '.join(map(str, turn_ids))} start as the "
            f"mean of the trained embeddings"
        )
        model.add_tokens(turn_ids)
        model_args = {**model_args, "vocab_size": model.config.vocab_size}
    if (tokenizer.vocab_size(tok_spec) or 0) > model.config.vocab_size:
        raise UserError(
            f"{cfg.dataset}'s tokenizer has {tokenizer.vocab_size(tok_spec)} tokens, more than the "
            f"vocab_size={model.config.vocab_size} of {cfg.init_from}"
        )
    if cfg.block_size > model.config.block_size:
        raise UserError(
            f"block_size={cfg.block_size} is longer than the {model.config.block_size} positions of "
            f"{cfg.init_from}; lower block_size"
        )
    keys = ("n_layer", "n_head", "n_kv_head", "n_embd", "bias", "vocab_size", "pos_encoding", "mlp")
    shape = ", ".join(f"{k}={model_args[k]!r}" for k in keys)
    note = f"init_from={cfg.init_from}: {shape} come from the weights (the config's model keys are not used)"
    if cfg.block_size < model.config.block_size:
        note += f"; block_size {model.config.block_size} cropped to {cfg.block_size}"
        model.crop_block_size(cfg.block_size)
    report(note)
    return model, {**model_args, "block_size": cfg.block_size}


def _untrained_turn_tokens(tok_spec, source_spec):
    """The ids of chat data's turn tokens (<|system|>, <|user|>, <|assistant|>, <|end|>) when the
    weights never trained on them: GPT-2's (new ids past its 50,257), or those a tokenizer of
    data/train_tokenizer.py reserved, in a run pretrained on plain text, where they never occur.
    None for weights already fine-tuned on conversations, or Llama 3's own format."""
    chat = tok_spec.get("chat")
    if not chat or chat.get("format") != "role_tokens" or "chat" in source_spec:
        return []
    return sorted(t["id"] for name, t in chat["tokens"].items() if name != "bos")


def _load_run(cfg, tok_spec, report):
    """(model, model_args, its tokenizer) from the best checkpoint of the run in cfg.init_from, with
    this run's dropout. Its tokenizer must be the data's (chat data may add turn tokens to it)."""
    trained, source_spec = checkpoint.load_model(cfg.init_from, "best", report=report)
    if not _same_vocabulary(source_spec, tok_spec):
        raise UserError(
            f"init_from={cfg.init_from!r} was trained on data tokenized with {_used(source_spec)}, but "
            f"{cfg.dataset} was prepared with {_used(tok_spec)}; prepare it again with that tokenizer"
        )
    model_args = {**dataclasses.asdict(trained.config), "dropout": cfg.dropout}
    model = GPT(GPTConfig(**model_args))
    model.load_state_dict(trained.state_dict())
    return model, model_args, source_spec


def _same_vocabulary(source_spec, tok_spec):
    """Whether data tokenized by tok_spec has the tokens of the weights' source_spec (chat data may
    add turn tokens)."""
    vocabulary = lambda spec: {k: v for k, v in spec.items() if k not in ("chat", "vocab_size", "path")}
    return vocabulary(source_spec) == vocabulary(tok_spec) and (
        "path" not in tok_spec or _same_contents(tok_spec["path"], source_spec.get("path", ""))
    )


def _used(spec):
    return spec.get("path") or spec.get("name") or spec["kind"]


def _same_contents(a, b):
    try:
        return filecmp.cmp(a, b, shallow=False)
    except OSError:
        return False
