"""Train a byte-level BPE tokenizer on your own text: DIR/tokenizer.json, ready for the prepare
scripts (--tokenizer=DIR/tokenizer.json) and data/chat/prepare.py.

    python data/train_tokenizer.py --input ../shared/data/tinyshakespeare/input.txt --vocab_size=4096 --out_dir=tok
    python data/train_tokenizer.py --input my_corpus/ --vocab_size=32768 --out_dir=tok        # .txt/.jsonl/.parquet
    python data/train_tokenizer.py --dataset=HuggingFaceFW/fineweb-edu --name=sample-10BT \\
        --max_chars=2e9 --vocab_size=65536 --out_dir=tok                                         # streamed from the Hub
    python data/fineweb_edu/prepare.py --input my_corpus/ --tokenizer=tok/tokenizer.json --out_dir=data/my_corpus

The model is the Hugging Face `tokenizers` library's BPE over bytes, as GPT-2's and Llama 3's
are: text is split by GPT-4's pattern (words with their leading space or punctuation, numbers
of up to 3 digits, runs of whitespace), each piece is read as UTF-8 bytes, and merges are
learned inside pieces only. Every byte is in the vocabulary, so any text encodes and decodes
back to itself. The vocabulary starts with the special tokens: <|endoftext|> (between
documents, found by tokenizer.py) and the chat template's turn tokens (gpt/data/chat_template.py).

The input is read as data/corpus.py reads it (the same files, --text_field, --txt_separator,
or a Hub dataset streamed with a seeded shuffle). The first --val_chars characters are held
out (whole documents, the one that crosses the line cut there), and the tokenizer's bytes per
token on them is printed next to GPT-2's.
"""

import argparse
import itertools
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

from configurator import Parser, UserError, run_main
from data import corpus
from gpt.data import tokenizer  # after the path line above
from gpt.data.chat_template import RESERVED_TOKENS

# GPT-4's (cl100k) split pattern, as Llama 3 also uses: a piece is a word with an optional leading
# non-letter, up to 3 digits, punctuation with trailing newlines, or whitespace
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PIECE_CHARS = 1 << 16  # long documents go to the trainer in pieces of about this size: its threads share out pieces
PIECE_CUT = re.compile(r"\n(?=\S)")  # after a newline that precedes a non-space: no split-pattern match crosses it


def parse_args(argv):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_argument_group("source: local files (--input), or a Hugging Face dataset")
    source.add_argument("--input", nargs="+", metavar="PATH", help="local .txt/.jsonl/.parquet files or directories")
    source.add_argument("--dataset", help="Hugging Face dataset name, e.g. HuggingFaceFW/fineweb-edu")
    source.add_argument("--name", help="its configuration, e.g. sample-10BT")
    source.add_argument("--split", default="train", help="its split (default: train)")
    source.add_argument("--revision", help="a git revision of the dataset repo (default: main)")
    source.add_argument("--text_field", default="text", help="the field or column holding the text (default: text)")
    source.add_argument(
        "--txt_separator",
        help=r"split .txt files into documents at this string, e.g. '\n\n' (default: one document per file)",
    )
    source.add_argument(
        "--shuffle_buffer",
        type=corpus.count,
        default=10_000,
        help="documents shuffled together; 0: input order (default: %(default)s)",
    )
    source.add_argument("--seed", type=int, default=1337, help="the document order (default: %(default)s)")
    source.add_argument(
        "--max_chars", type=corpus.count, help="train on at most this many characters, e.g. 2e9 (default: all)"
    )
    source.add_argument(
        "--val_chars",
        type=corpus.count,
        default=100_000,
        help="characters held out to measure compression (default: %(default)s)",
    )
    out = p.add_argument_group("tokenizer")
    out.add_argument(
        "--vocab_size", type=corpus.count, required=True, help="tokens in all, special tokens included, e.g. 32768"
    )
    out.add_argument("--out_dir", required=True, help="tokenizer.json is written here")
    args = p.parse_args(argv)
    if (args.input is None) == (args.dataset is None):
        raise UserError("pass exactly one source: --input PATH (local files) or --dataset NAME (Hugging Face)")
    if args.txt_separator is not None:
        args.txt_separator = args.txt_separator.replace("\\n", "\n").replace("\\t", "\t")
    smallest = 256 + len(RESERVED_TOKENS) + 1
    if args.vocab_size < smallest:
        raise UserError(
            f"--vocab_size={args.vocab_size} leaves no merges: the 256 bytes and {len(RESERVED_TOKENS)} "
            f"special tokens take {smallest - 1}; use at least {smallest}"
        )
    return args


def split_held_out(docs, val_chars):
    """(held-out documents, iterator of the rest): the first val_chars characters of the stream."""
    val, size = [], 0
    for doc in docs:
        if size + len(doc) >= val_chars:
            cut = val_chars - size
            val.append(doc[:cut])
            return val, itertools.chain([doc[cut:]] if doc[cut:].strip() else [], docs)
        val.append(doc)
        size += len(doc)
    return val, iter(())


def pieces(docs, max_chars):
    """The documents cut into pieces of about PIECE_CHARS, up to max_chars characters in all.
    Cuts fall where the split pattern would end a piece anyway, so the words the trainer counts
    are the same as on whole documents."""
    total = 0
    for doc in docs:
        if max_chars is not None and total + len(doc) > max_chars:
            doc = doc[: max_chars - total]
        start = 0
        while start < len(doc):
            cut = PIECE_CUT.search(doc, start + PIECE_CHARS) if len(doc) - start > PIECE_CHARS else None
            end = cut.end() if cut else len(doc)
            yield doc[start:end]
            start = end
        total += len(doc)
        if max_chars is not None and total >= max_chars:
            return


def new_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),  # bytes -> GPT-2's printable stand-ins
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train(docs, vocab_size, max_chars):
    """(tokenizers.Tokenizer, characters read, seconds)."""
    from tokenizers import pre_tokenizers, trainers
    from tqdm import tqdm

    tok = new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(RESERVED_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=sys.stderr.isatty(),
    )
    chars = 0

    def counted(texts, bar):
        nonlocal chars
        for text in texts:
            chars += len(text)
            bar.update(len(text))
            yield text

    start = time.perf_counter()
    with tqdm(total=max_chars, unit="char", unit_scale=True, desc="reading", disable=None) as bar:
        tok.train_from_iterator(counted(pieces(docs, max_chars), bar), trainer)
    return tok, chars, time.perf_counter() - start


def bytes_per_token(encode_batch, docs):
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    return n_bytes / max(1, sum(map(len, encode_batch(docs))))


def main(argv=None):
    args = parse_args(argv)
    docs = corpus.documents(args)
    val, rest = split_held_out(docs, args.val_chars)
    tok, chars, seconds = train(rest, args.vocab_size, args.max_chars)
    if chars == 0:
        raise UserError(f"no text left to train on after the {args.val_chars:,} held-out characters; lower --val_chars")
    try:
        os.makedirs(args.out_dir, exist_ok=True)
        path = os.path.join(args.out_dir, "tokenizer.json")
        tok.save(path + ".tmp")
        os.replace(path + ".tmp", path)
    except OSError as e:
        raise UserError(f"cannot write to --out_dir {args.out_dir} ({e.strerror})")
    vocab = tok.get_vocab_size()
    print(f"trained {vocab:,} tokens on {chars:,} characters in {seconds:.1f} s: {chars / seconds:,.0f} characters/s")
    if vocab < args.vocab_size:
        print(
            f"note: the text has only {vocab:,} distinct tokens to learn, fewer than --vocab_size={args.vocab_size:,}"
        )
    special = ", ".join(f"{t} {tok.token_to_id(t)}" for t in RESERVED_TOKENS)
    print(f"wrote {path} (special tokens: {special})")
    if val:
        ours = bytes_per_token(lambda d: [e.ids for e in tok.encode_batch(d, add_special_tokens=False)], val)
        line = f"held-out text (the first {sum(map(len, val)):,} characters): {ours:.3f} bytes/token"
        try:
            gpt2 = bytes_per_token(tokenizer.local_encoding("gpt2").encode_ordinary_batch, val)
            line += f"; GPT-2 (50,257 tokens): {gpt2:.3f} bytes/token"
        except UserError as e:  # no local copy of GPT-2's vocabulary: the comparison is skipped, not downloaded
            line += f"; GPT-2 not compared ({e})"
        print(line)
    return 0


if __name__ == "__main__":
    run_main(main)
