"""Conversations -> token files, per-token training masks and meta.json, for supervised
finetuning (SFT) with the loss on the assistant's turns only.

    python data/chat/prepare.py --input conv.jsonl --out_dir=data/my_chat                     # GPT-2 BPE + turn tokens
    python data/chat/prepare.py --input conv.jsonl --tokenizer=tok/tokenizer.json --out_dir=data/my_chat
    python data/chat/prepare.py --input train.jsonl --val_input val.jsonl --out_dir=data/my_chat --block_size=512
    python data/chat/prepare.py --dataset=HuggingFaceTB/smol-smoltalk --val_split=test --out_dir=data/smoltalk
    python data/chat/prepare.py --dataset=HuggingFaceTB/smoltalk --name=everyday-conversations --out_dir=data/everyday

The input is one conversation per line (.jsonl, or .jsonl.gz):
    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}
A system message may only come first; a conversation needs an assistant turn and ends with
one; no turn is empty. A record that breaks a rule stops the run with one line naming the
file, the line and the problem; --skip_bad=True skips such records instead and counts them by
reason. Blank lines are not records.

Written to out_dir (the template is in gpt/data/chat_template.py):
    train.bin, val.bin              the conversations' token ids, one after another (gpt/data/token_files.py format)
    train_mask.npy, val_mask.npy    uint8, one per token: 1 where the token is a trained target (the
                                    assistant's content and its end-of-turn token), else 0
    train_starts.npy, val_starts.npy   int64: where each conversation starts (the first is 0)
    meta.json                       the tokenizer (vocab_size counts the turn tokens) and "chat": the
                                    format, its tokens and ids, new_token_ids, the Jinja chat_template,
                                    block_size and the counts
meta.json is written last: a directory with one holds a whole preparation.

val is --val_frac of the conversations, drawn with --seed (or the records of --val_input). A
training row starts at a conversation's start and holds block_size + 1 tokens, so a longer
conversation's later tokens are never trained: they are counted and reported, and kept unless
--drop_long=True drops those conversations. Everything is held in memory (some 10 bytes per token).
"""

import argparse
import gzip
import json
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo root

import numpy as np

from configurator import Parser, UserError, run_main
from data import corpus
from gpt.data import token_files, tokenizer
from gpt.data.chat_template import ROLES, Template

SPLITS = ("train", "val")


def flag(text):
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not True or False")


def parse_args(argv):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_argument_group("source: local .jsonl files (--input), or a Hugging Face dataset")
    source.add_argument("--input", nargs="+", metavar="FILE", help="conversations, one JSON object per line")
    source.add_argument("--val_input", nargs="+", metavar="FILE", help="the val conversations (replaces --val_frac)")
    source.add_argument(
        "--dataset", help="Hugging Face dataset with a 'messages' column, e.g. HuggingFaceTB/smol-smoltalk"
    )
    source.add_argument("--name", help="its configuration, e.g. everyday-conversations (HuggingFaceTB/smoltalk)")
    source.add_argument("--split", default="train", help="its split for train (default: train)")
    source.add_argument("--val_split", help="its split for val, e.g. test (replaces --val_frac)")
    out = p.add_argument_group("output")
    out.add_argument("--out_dir", required=True, help="where the token files, masks and meta.json go")
    out.add_argument(
        "--tokenizer",
        default="gpt2",
        help="gpt2 (or another tiktoken name), or a tokenizer.json from "
        "data/train_tokenizer.py or Llama 3 (default: gpt2)",
    )
    out.add_argument(
        "--val_frac",
        type=float,
        default=0.05,
        help="fraction of the conversations held out for val (default: %(default)s)",
    )
    out.add_argument("--seed", type=int, default=1337, help="which conversations go to val (default: %(default)s)")
    out.add_argument(
        "--block_size",
        type=int,
        default=1024,
        help="the training context: longer conversations are reported (default: %(default)s)",
    )
    out.add_argument(
        "--drop_long",
        type=flag,
        nargs="?",
        const=True,
        default=False,
        help="drop conversations longer than block_size + 1 tokens (default: keep them)",
    )
    out.add_argument(
        "--skip_bad",
        type=flag,
        nargs="?",
        const=True,
        default=False,
        help="skip bad records, counted by reason (default: stop at the first)",
    )
    args = p.parse_args(argv)
    if (args.input is None) == (args.dataset is None):
        raise UserError("pass exactly one source: --input FILE (jsonl) or --dataset NAME (Hugging Face)")
    if args.val_input and args.dataset or args.val_split and args.input:
        raise UserError("--val_input goes with --input, --val_split with --dataset")
    if not 0 < args.val_frac < 1:
        raise UserError(f"--val_frac={args.val_frac} must be in (0, 1)")
    if args.block_size < 1:
        raise UserError(f"--block_size={args.block_size} must be at least 1")
    return args


# ---------------------------------------------------------------------------- records


def problem(record):
    """(reason, description) of what is wrong with a record, or None for a good conversation."""
    if not isinstance(record, dict):
        return "not JSON", f"not a JSON object but {type(record).__name__}"
    messages = record.get("messages")
    if not isinstance(messages, list) or not messages:
        return "no messages", 'no "messages" list (or an empty one)'
    for j, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return "bad message", f'message {j} is not {{"role": "...", "content": "..."}}'
        if m["role"] not in ROLES:
            return "unknown role", f"message {j} has the unknown role {m['role']!r} (roles: {', '.join(ROLES)})"
        if not m["content"].strip():
            return "empty turn", f"message {j} ({m['role']}) is empty"
        if m["role"] == "system" and j > 1:
            return "system not first", f"message {j} is a system message; only the first may be"
    if all(m["role"] != "assistant" for m in messages):
        return "no assistant turn", "no assistant turn: nothing to train on"
    if messages[-1]["role"] != "assistant":
        return "does not end with the assistant", f"ends with a {messages[-1]['role']} turn, not the assistant's"
    return None


def file_records(paths):
    """(where, record) for every non-blank line: where is 'file:line'; a line that is not JSON
    comes as its text's exception."""
    for path in paths:
        if not os.path.isfile(path):
            raise UserError(f"--input {path} does not exist")
        opener = gzip.open if path.endswith(".gz") else open
        try:
            with opener(path, "rt", encoding="utf-8") as f:
                for line_no, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except ValueError as e:
                        record = e
                    yield f"{path}:{line_no}", record
        except UnicodeDecodeError:
            raise UserError(f"{path} is not UTF-8 text")
        except (OSError, EOFError) as e:  # unreadable, or a damaged .gz
            raise UserError(f"cannot read {path} ({e})")


def hub_records(name, config, split):
    """(where, row) of a Hugging Face dataset's split, streamed (needs the network)."""
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
        for i, row in enumerate(ds):
            yield f"{name}/{split} row {i}", row
    except Exception as e:  # no network, an unknown name, config or split: the library's message says which
        raise UserError(
            f"cannot read {name} (name={config}, split={split}): {corpus.first_line(e)}; or pass local "
            f"files with --input"
        )


def conversations(records, template, skip_bad, skipped):
    """(ids, mask) uint32/uint8 arrays for each good record; bad ones raise, or are counted in skipped."""
    from tqdm import tqdm

    for where, record in tqdm(records, unit="conv", disable=None):
        bad = ("not JSON", f"not JSON ({record})") if isinstance(record, ValueError) else problem(record)
        if bad is not None:
            if not skip_bad:
                raise UserError(f"{where}: {bad[1]}; fix it, or pass --skip_bad=True to skip bad records")
            skipped[bad[0]] += 1
            continue
        ids, mask = template.render(record["messages"])
        yield np.array(ids, np.uint32), np.array(mask, np.uint8)


def draw_val(convs, val_frac, seed):
    """{"train": [...], "val": [...]}: a seeded draw of whole conversations, each split in input order."""
    n = len(convs)
    n_val = max(1, round(val_frac * n))
    if n - n_val < 1:
        raise UserError(
            f"{n} good conversation(s): too few to hold out --val_frac={val_frac} for val and train on the rest"
        )
    is_val = np.zeros(n, bool)
    is_val[np.random.default_rng(seed).choice(n, n_val, replace=False)] = True
    return {"train": [c for c, v in zip(convs, is_val) if not v], "val": [c for c, v in zip(convs, is_val) if v]}


# ---------------------------------------------------------------------------- writing


def save_npy(path, array):
    """np.save, atomically as token_files.write: a file under its final name is complete."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        np.save(f, array)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_split(out_dir, split, convs, dtype):
    lengths = np.array([len(ids) for ids, _ in convs], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    token_files.write(os.path.join(out_dir, f"{split}.bin"), np.concatenate([ids for ids, _ in convs]).astype(dtype))
    save_npy(os.path.join(out_dir, f"{split}_mask.npy"), np.concatenate([mask for _, mask in convs]))
    save_npy(os.path.join(out_dir, f"{split}_starts.npy"), starts)


def report(split, long, row, skipped, drop_long):
    """Print each split's counts, the bad records skipped and the conversations longer than a row;
    returns the counts meta.json records."""
    counts = {}
    for s in SPLITS:
        n_tokens = sum(len(ids) for ids, _ in split[s])
        trained = sum(int(mask.sum()) for _, mask in split[s])
        counts[s] = {
            "conversations": len(split[s]),
            "tokens": n_tokens,
            "trained_tokens": trained,
            "long": len(long[s]),  # longer than block_size + 1 tokens: dropped with drop_long, else kept
            "long_untrained_tokens": 0 if drop_long else sum(int(mask[row:].sum()) for mask in long[s]),
        }
        print(
            f"{s}: {len(split[s]):,} conversations, {n_tokens:,} tokens, {trained:,} trained ({trained / n_tokens:.1%})"
        )
    if skipped:
        print(
            f"skipped {sum(skipped.values()):,} bad records: "
            + ", ".join(f"{n:,} {why}" for why, n in skipped.most_common())
        )
    n_long = sum(c["long"] for c in counts.values())
    if n_long:
        untrained = sum(c["long_untrained_tokens"] for c in counts.values())
        done = (
            "dropped (--drop_long=True)"
            if drop_long
            else f"kept: a row takes their first {row:,} tokens, so {untrained:,} of their trained tokens are never "
            f"trained (--drop_long=True drops them, or raise --block_size)"
        )
        print(
            f"{n_long:,} conversations (train {counts['train']['long']:,}, val {counts['val']['long']:,}) are longer "
            f"than block_size + 1 = {row:,} tokens; {done}"
        )
    return counts


def main(argv=None):
    args = parse_args(argv)
    spec = tokenizer.make_spec(args.tokenizer)
    template = Template(spec)
    skipped = Counter()
    if args.input is not None:
        train_records = file_records(args.input)
        val_records = file_records(args.val_input) if args.val_input else None
    else:
        train_records = hub_records(args.dataset, args.name, args.split)
        val_records = hub_records(args.dataset, args.name, args.val_split) if args.val_split else None
    split = {"train": list(conversations(train_records, template, args.skip_bad, skipped))}
    if val_records is not None:
        split["val"] = list(conversations(val_records, template, args.skip_bad, skipped))
    else:
        split = draw_val(split["train"], args.val_frac, args.seed)

    # a row holds block_size + 1 tokens from a conversation's start: targets past that are never trained
    row = args.block_size + 1
    long = {s: [mask for ids, mask in convs if len(ids) > row] for s, convs in split.items()}
    if args.drop_long:
        split = {s: [c for c in convs if len(c[0]) <= row] for s, convs in split.items()}
    for s in SPLITS:
        if not split[s]:
            raise UserError(
                f"no {s} conversations left"
                + (" after --drop_long" if args.drop_long else "")
                + "; add conversations"
                + (" or raise --block_size" if args.drop_long else "")
            )

    counts = report(split, long, row, skipped, args.drop_long)
    meta = {
        **spec,
        "vocab_size": template.vocab_size,
        "chat": {
            **template.meta(),
            "block_size": args.block_size,
            "drop_long": args.drop_long,
            "counts": counts,
            "skipped": dict(skipped),
        },
    }
    dtype = token_files.dtype_for(template.vocab_size)
    try:
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, "meta.json")
        if os.path.exists(path):  # an earlier preparation's: until the new one is written the directory is incomplete
            os.remove(path)
        for s in SPLITS:
            write_split(args.out_dir, s, split[s], dtype)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
        os.replace(path + ".tmp", path)
    except OSError as e:
        raise UserError(f"cannot write to --out_dir {args.out_dir} ({e.strerror or e})")
    print(
        f"wrote {args.out_dir}: train.bin, val.bin, *_mask.npy, *_starts.npy, meta.json ({template.format} template, "
        f"vocab_size {template.vocab_size:,})"
    )
    return 0


if __name__ == "__main__":
    run_main(main)
