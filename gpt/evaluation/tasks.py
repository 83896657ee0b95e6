"""The tasks that say how good a model is: multiple choice (HellaSwag, your own questions) and
the loss of a data split in nats per token and bits per byte. eval.py runs them on a finished
model; train.py runs HellaSwag and bits per byte during training.

    from gpt.evaluation import tasks
    encoded = tasks.encode_examples(tasks.load_hellaswag(examples=1000), tok_spec)
    tasks.score_choices(model, encoded, block_size, rt)     # {'acc': ..., 'acc_norm_tokens': ..., ...}
    tasks.split_loss(model, token_files.Tokens.open("data/openwebtext", "val"), block_size, rt, token_bytes)

Multiple choice (HellaSwag, --mc_path) is scored as the GPT-2 reproductions (build-nanogpt,
llm.c) score it: each choice is the context's tokens followed by the tokens of " " + choice,
and the model's cross-entropy is summed over the choice's tokens only. acc counts the examples
whose right choice has the lowest total loss; two acc_norms are reported, each by its name:
acc_norm_tokens (the lowest mean loss per token: build-nanogpt's acc_norm) and acc_norm_chars
(the lowest loss per character of the choice: lm-evaluation-harness's acc_norm).
--hellaswag_style=harness builds the prompt as lm-evaluation-harness does (its preprocessing of
activity_label: ctx_a Ctx_b and of the endings, context + " " + choice encoded whole); the
published lm-eval tables are its acc and acc_norm_chars. CORE is gpt/evaluation/core.py's. Bits per byte
are the total nats over ln 2 times the UTF-8 bytes of the predicted tokens' text, so models with
different tokenizers compare.

Under torchrun the examples (or windows) are shared out between the ranks and the sums all-reduced."""

import json
import math
import os
import re
from typing import NamedTuple

import numpy as np
import torch

from configurator import UserError
from gpt.data import download, tokenizer
from gpt.data.batches import ChatData
from gpt.device.runtime import to_device
from gpt.evaluation import scoring

HELLASWAG_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
HELLASWAG_PATH = os.path.join("data", "hellaswag", "hellaswag_val.jsonl")  # gitignored: data/*/*.jsonl
HELLASWAG_SUBSET_SEED = 0  # hellaswag_examples picks the same examples in every run


class Example(NamedTuple):
    context: str
    choices: list  # of str
    answer: int  # index of the right choice


# ---------------------------------------------------------------------------- reading tasks


def hellaswag_file(path=""):
    """The HellaSwag validation jsonl: `path` when given, else the cached copy, downloaded the first time."""
    if path:
        if not os.path.isfile(path):
            raise UserError(f"hellaswag_path={path} does not exist; give a HellaSwag jsonl (ctx, endings, label)")
        return path
    # no published sha256 for this file: it is checked by parsing (read_jsonl)
    return download.fetch(HELLASWAG_URL, None, HELLASWAG_PATH, local="--hellaswag_path=FILE")


def read_jsonl(path, fields):
    """[(where, record)] from a jsonl file, every record a JSON object with `fields`."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror})")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text; give a jsonl file")
    records = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where} is not a JSON object ({e.msg}); each line must be one record")
        if not isinstance(record, dict):
            raise UserError(f"{where} is not a JSON object; each line must be one record")
        missing = [k for k in fields if k not in record]
        if missing:
            raise UserError(f"{where} lacks {', '.join(map(repr, missing))}; every record needs {', '.join(fields)}")
        records.append((where, record))
    if not records:
        raise UserError(f"{path} holds no records")
    return records


def _example(where, context, choices, answer):
    if not isinstance(context, str) or not context:
        raise UserError(f"{where}: the context must be a non-empty string")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise UserError(f"{where}: the choices must be a list of at least two non-empty strings")
    if isinstance(answer, str) and answer.isdigit():  # HellaSwag's files hold some labels as strings
        answer = int(answer)
    if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
        raise UserError(f"{where}: the answer must be the index of a choice, 0 to {len(choices) - 1}, not {answer!r}")
    return Example(context, choices, answer)


def harness_preprocess(text):
    """lm-evaluation-harness's HellaSwag clean-up (tasks/hellaswag/utils.py): WikiHow's [title]
    becomes a full stop, other [bracketed] markers go, double spaces become one."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub("\\[.*?\\]", "", text).replace("  ", " ")


def load_hellaswag(path="", examples=0, style="nanogpt"):
    """HellaSwag's examples (official format: ctx, endings, label, ...); examples > 0: that
    many, the same seeded sample every time. style 'nanogpt': the context is ctx, the choices
    the endings (build-nanogpt, llm.c); 'harness': lm-eval's query, activity_label + ": " +
    ctx_a + " " + ctx_b.capitalize(), and the endings, both through harness_preprocess."""
    fields = (
        ("ctx", "endings", "label") if style == "nanogpt" else ("activity_label", "ctx_a", "ctx_b", "endings", "label")
    )
    records = read_jsonl(hellaswag_file(path), fields)
    if style == "nanogpt":
        found = [_example(w, r["ctx"], r["endings"], r["label"]) for w, r in records]
    else:
        for w, r in records:
            if (
                not all(isinstance(r[k], str) for k in fields[:3])
                or not isinstance(r["endings"], list)
                or not all(isinstance(e, str) for e in r["endings"])
            ):
                raise UserError(f"{w}: activity_label, ctx_a and ctx_b must be strings and endings a list of strings")
        found = [
            _example(
                w,
                harness_preprocess(f"{r['activity_label']}: {r['ctx_a']} {r['ctx_b'].capitalize()}"),
                [harness_preprocess(e) for e in r["endings"]],
                r["label"],
            )
            for w, r in records
        ]
    if 0 < examples < len(found):
        keep = np.random.default_rng(HELLASWAG_SUBSET_SEED).permutation(len(found))[:examples]
        found = [found[i] for i in sorted(keep)]
    return found


def load_mc(path):
    """Your own multiple-choice questions: jsonl with context, choices, answer."""
    return [
        _example(w, r["context"], r["choices"], r["answer"])
        for w, r in read_jsonl(path, ("context", "choices", "answer"))
    ]


def encode_examples(examples, tok_spec, task="hellaswag", joint=False):
    """[(context ids, [ids of " " + choice, ...], answer, [characters of each choice])], with
    the model's tokenizer. joint=False encodes the context and each " " + choice apart and
    joins the ids (build-nanogpt); joint=True encodes context + " " + choice whole and takes the
    ids past the context's own (lm-eval's causal models, which first move the context's trailing
    spaces to the continuation)."""
    if tok_spec["kind"] == "char":
        raise UserError(
            f"{task} needs a tokenizer that encodes any text; this model is character-level "
            f"({len(tok_spec['chars'])} characters): evaluate it with --tasks=val,test"
        )
    encode, _ = tokenizer.load(tok_spec)
    out = []
    for e in examples:
        context, continuations = e.context, [" " + c for c in e.choices]
        if joint:
            spaces = len(context) - len(context.rstrip())
            context, continuations = context.rstrip(), [context[len(context) - spaces :] + c for c in continuations]
        ids = encode(context)
        choices = [encode(context + c)[len(ids) :] if joint else encode(c) for c in continuations]
        out.append((ids, choices, e.answer, [len(c) for c in e.choices]))
    return out


# ---------------------------------------------------------------------------- multiple choice


def _cropped(context, choice, keep):
    """(ids, n): context + choice cut to their last `keep` tokens, n of the choice's tokens scored
    (those that have a token before them)."""
    ids = (context + choice)[-keep:]
    return ids, min(len(choice), len(ids) - 1)


def score_choices(model, encoded, block_size, rt, batch_size=16, desc=None):
    """{"acc", "acc_norm_tokens", "acc_norm_chars", "n"} over encoded examples (encode_examples).
    The right choice has the lowest total loss (acc), the lowest loss per token (acc_norm_tokens:
    build-nanogpt, llm.c) or per character of the choice, its leading space not counted
    (acc_norm_chars: lm-eval's acc_norm). The sums stay on the device until one read at the end."""
    was_training = getattr(model, "training", False)
    model.eval()
    mine = encoded[rt.rank :: rt.world_size]
    # the same number of forward passes on every rank: under FSDP each one is a collective
    n_batches = math.ceil(math.ceil(len(encoded) / rt.world_size) / batch_size)
    # right by each rule, examples
    sums = torch.tensor([0.0, 0.0, 0.0, len(mine)], dtype=scoring.sum_dtype(rt)).to(rt.device)
    for b in scoring.progress(range(n_batches), desc, rt):
        batch = mine[b * batch_size : (b + 1) * batch_size]
        # an empty batch (this rank has run out) still runs one forward, with its answer -1: never counted
        todo = batch or [(*encoded[0][:2], -1, encoded[0][3])]
        rows = [_cropped(context, choice, block_size + 1) for context, choices, _, _ in todo for choice in choices]
        totals, _ = scoring.row_losses(model, rows, rt)
        per_row = torch.tensor(
            [[1.0, n, chars] for (_, n), chars in zip(rows, (c for *_, cs in todo for c in cs))], dtype=totals.dtype
        )
        per_row = to_device(per_row, rt)  # (rows, 3): the divisor of each rule
        examples = [(len(choices), answer) for _, choices, answer, _ in todo]
        for k in range(3):
            sums[k] += scoring.pick(totals / per_row[:, k], examples, rt).sum()
    model.train(was_training)
    right, right_tokens, right_chars, n = scoring.all_reduce(sums, rt).tolist()
    return {"acc": right / n, "acc_norm_tokens": right_tokens / n, "acc_norm_chars": right_chars / n, "n": int(n)}


# ---------------------------------------------------------------------------- splits and bits per byte


def hellaswag_scores(model, examples, block_size, rt, batch_size):
    """(score_choices' scores, the line train.py's log prints of them)."""
    s = score_choices(model, examples, block_size, rt, batch_size)
    line = f"hellaswag acc {s['acc']:.4f}, acc_norm_tokens {s['acc_norm_tokens']:.4f}, acc_norm_chars {s['acc_norm_chars']:.4f}"
    return s, f"{line} ({s['n']} examples)"


def target_bytes(data, offsets, block_size, token_bytes):
    """UTF-8 bytes of the text of the targets of the windows starting at `offsets` (any shape):
    the ids at offset+1 ... offset+block_size. Host work only, no model."""
    offsets = np.asarray(offsets).reshape(-1)
    total = 0
    for i in range(0, len(offsets), 256):  # bounded memory for long windows
        chunk = offsets[i : i + 256]
        ids = data[chunk[:, None] + 1 + np.arange(block_size)]
        known = ids < len(token_bytes)  # ids past the tokenizer's table (a vocabulary padded in meta.json) are no text
        total += int(token_bytes[np.where(known, ids, 0)][known].sum())
    return total


def eval_bytes(windows, tok_spec, block_size, say=print):
    """Bits per byte's denominators in training, {split: bytes} of the targets of the eval windows
    ({split: (data, offsets)}, fixed, so counted once, on the host) but train's. None (no bpb)
    when the tokenizer's vocabulary is not on this machine: training needs only the token ids,
    and never downloads. Chat data: None too; its loss covers only the assistant's tokens."""
    if any(isinstance(data, ChatData) for data, _ in windows.values()):
        return None
    try:
        token_bytes = tokenizer.token_bytes(tok_spec, offline=True)
    except UserError as e:
        say(f"note: no bits per byte in this run: {e}")
        return None
    return {
        split: target_bytes(data, offsets, block_size, token_bytes)
        for split, (data, offsets) in windows.items()
        if split != "train"
    }


def bits_per_byte(loss, n_tokens, n_bytes):
    """Mean loss in nats per token over n_tokens whose text is n_bytes -> bits per byte."""
    return loss * n_tokens / (math.log(2) * n_bytes)


@torch.no_grad()
def split_loss(model, data, block_size, rt, token_bytes, batch_size=16, max_tokens=0, desc=None):
    """{"loss", "bpb", "tokens"} of a split: consecutive windows of block_size tokens from its
    start, so each of the first max_tokens (0: all) tokens is predicted once."""
    n_windows = (len(data) - 1) // block_size
    if max_tokens:
        n_windows = min(n_windows, max(1, max_tokens // block_size))
    if n_windows == 0:
        raise UserError(f"the split has {len(data)} tokens, fewer than block_size + 1 = {block_size + 1}")
    mine = np.arange(rt.rank, n_windows, rt.world_size) * block_size
    n_batches = math.ceil(math.ceil(n_windows / rt.world_size) / batch_size)  # equal on every rank (FSDP)
    was_training = getattr(model, "training", False)
    model.eval()
    # the windows are fixed, so their targets' bytes are counted once, on the host, before the
    # loop; the loss sum stays on the device: the loop queues GPU work and never waits for it
    n_bytes = target_bytes(data, mine, block_size, token_bytes)
    # nats, tokens, bytes
    sums = torch.tensor([0.0, len(mine) * block_size, n_bytes], dtype=scoring.sum_dtype(rt)).to(rt.device)
    for b in scoring.progress(range(n_batches), desc, rt):
        offsets = mine[b * batch_size : (b + 1) * batch_size]
        rows = data[(offsets if len(offsets) else np.zeros(1, np.int64))[:, None] + np.arange(block_size + 1)]
        t = to_device(torch.from_numpy(rows.astype(np.int64)), rt)
        with rt.autocast():
            _, loss = model(t[:, :-1], t[:, 1:])  # mean over (B, T)
        if len(offsets):
            sums[0] += loss.to(sums.dtype) * (len(offsets) * block_size)
    model.train(was_training)
    nats, n_tokens, n_bytes = scoring.all_reduce(sums, rt).tolist()
    return {"loss": nats / n_tokens, "bpb": bits_per_byte(nats / n_tokens, n_tokens, n_bytes), "tokens": int(n_tokens)}
