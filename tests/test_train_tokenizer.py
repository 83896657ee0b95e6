"""data/train_tokenizer.py: a byte-level BPE trained on local text round-trips any Unicode text,
keeps its special tokens whole, prints a compression that recomputes, and feeds the corpus
routine as it is."""

import re

import numpy as np
import pytest
from conftest import make_text
from processes import load_script, run_script

from configurator import UserError
from data import corpus
from gpt.data import token_files, tokenizer
from gpt.data.chat_template import RESERVED_TOKENS

train_tokenizer = load_script("data/train_tokenizer.py")

UNICODE = (
    "Hello, world! It's 'll 've 're ¿qué? naïve café — “quotes” 東京タワー 北京 한국어 Ελληνικά русский العربية עברית "
    "🙂👍🏽 👩‍👩‍👧 🇫🇷 e\u0301 a\u0308\u0323 \u200b\u200d zero width, \x00\x01\x1f\x7f control, \t\r\n\x0b\x0c, "
    "\U0001d11e \U0010fffd private \ue000, 12345678901234 3.14159 \\ "
)
# code points: ASCII, Latin, combining marks, Greek and Cyrillic, Hebrew and Arabic, Devanagari, kana, CJK,
# Hangul, private use, emoji, the astral planes
RANGES = [(0x00, 0x7F), (0x80, 0x24F), (0x300, 0x36F), (0x370, 0x52F), (0x590, 0x6FF), (0x900, 0x97F)]
RANGES += [(0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xE000, 0xF8FF), (0x1F300, 0x1FAFF)]
RANGES += [(0x10000, 0x10FFFF)]


def random_unicode(rng, n):
    """n characters from RANGES, never a surrogate (no UTF-8 exists for one)."""
    chars = []
    while len(chars) < n:
        lo, hi = RANGES[rng.integers(len(RANGES))]
        c = int(rng.integers(lo, hi + 1))
        if not 0xD800 <= c <= 0xDFFF:
            chars.append(chr(c))
    return "".join(chars)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(spec, the input text, the printed output) of a 400-token tokenizer trained by the command."""
    root = tmp_path_factory.mktemp("train_tokenizer")
    text = make_text(40000, seed=2) + "\n" + UNICODE + "\n" + make_text(20000, seed=4)
    (root / "input.txt").write_text(text, encoding="utf-8")

    args = ["--input", root / "input.txt", "--vocab_size=400", f"--out_dir={root / 'tok'}", "--val_chars=5000"]
    result = run_script("data/train_tokenizer.py", *args)
    assert result.returncode == 0, result.stderr
    return tokenizer.make_spec(str(root / "tok" / "tokenizer.json")), text, result.stdout


def test_round_trip_on_arbitrary_unicode(trained):
    """decode(encode(s)) == s, for fixed hard cases and random text from many scripts."""
    spec, _, _ = trained
    encode, decode = tokenizer.load(spec)
    ordinary = tokenizer.batch_encoder(spec)  # how the corpus routine encodes documents
    rng = np.random.default_rng(0)
    texts = [UNICODE, "", " ", "\n\n\n", "  x  ", *(random_unicode(rng, int(rng.integers(1, 300))) for _ in range(300))]
    for text in texts:
        assert decode(encode(text)) == text
        assert decode(ordinary([text])[0]) == text
    typed = "a <|endoftext|> b <|user|>"
    assert decode(ordinary([typed])[0]) == typed  # special-token text in a document is text
    # bytes never seen in training still encode: every byte is a token
    assert decode(encode("\U0001f9ff\x05")) == "\U0001f9ff\x05"


def test_special_tokens_are_single_ids(trained):
    """The reserved tokens come first, each one id, as special tokens; documents read their text
    as plain text (a page that contains '<|endoftext|>' does not end there)."""
    spec, _, _ = trained
    encode, _ = tokenizer.load(spec)
    assert spec["eot"] == "<|endoftext|>" and tokenizer.eot(spec) == 0
    for i, text in enumerate(RESERVED_TOKENS):
        assert encode(text) == [i]
        assert len(tokenizer.batch_encoder(spec)([text])[0]) > 1
    ids = encode("hi<|user|>there<|end|>")
    assert ids.count(2) == 1 and ids[-1] == 4 and set(ids) & {0, 1, 3} == set()
    from tokenizers import Tokenizer

    added = Tokenizer.from_file(spec["path"]).get_added_tokens_decoder()
    assert {i: (t.content, t.special) for i, t in added.items()} == {
        i: (t, True) for i, t in enumerate(RESERVED_TOKENS)
    }


def test_vocab_size_and_printed_compression(trained):
    """The vocabulary has the size asked for, and the printed bytes per token recompute from the
    held-out text (the first --val_chars characters) for this tokenizer and for GPT-2."""
    spec, text, out = trained
    assert spec["vocab_size"] == 400
    m = re.search(
        r"held-out text \(the first 5,000 characters\): ([\d.]+) bytes/token; GPT-2 \(50,257 tokens\): ([\d.]+)", out
    )
    assert m, out
    held_out = text[:5000]
    encode, _ = tokenizer.load(spec)
    ours = len(held_out.encode()) / len(encode(held_out))
    gpt2 = len(held_out.encode()) / len(tokenizer.encoding("gpt2").encode_ordinary(held_out))
    assert float(m.group(1)) == pytest.approx(ours, abs=1e-3) and float(m.group(2)) == pytest.approx(gpt2, abs=1e-3)
    trained_chars = int(re.search(r"on ([\d,]+) characters", out).group(1).replace(",", ""))
    assert trained_chars == len(text.replace("\r\n", "\n")) - 5000  # corpus.py reads text files with universal newlines
    assert "characters/s" in out


def test_pieces_keep_the_words(monkeypatch):
    """Long documents go to the trainer in pieces; the pieces split into exactly the words of
    the whole text, so the counts BPE learns from are unchanged."""
    monkeypatch.setattr(train_tokenizer, "PIECE_CHARS", 50)
    pre = train_tokenizer.new_tokenizer().pre_tokenizer
    doc = make_text(3000, seed=7).replace(".", ".\n\n").replace("!", "!\n  ") + "\n\t\nend 東京 🙂\n" * 5
    pieces = list(train_tokenizer.pieces([doc], None))
    assert len(pieces) > 10 and "".join(pieces) == doc
    words = [w for w, _ in pre.pre_tokenize_str(doc)]
    assert [w for p in pieces for w, _ in pre.pre_tokenize_str(p)] == words
    assert "".join(train_tokenizer.pieces([doc, doc], 4000)) == (doc + doc)[:4000]  # --max_chars


def test_held_out_split():
    docs = ["abc", "defgh", "ij", "klm"]
    val, rest = train_tokenizer.split_held_out(iter(docs), 5)
    assert val == ["abc", "de"] and list(rest) == ["fgh", "ij", "klm"]
    val, rest = train_tokenizer.split_held_out(iter(docs), 100)
    assert val == docs and list(rest) == []


def test_corpus_routine_takes_it(trained, tmp_path):
    """prepare.py --tokenizer=DIR/tokenizer.json: documents end with <|endoftext|> and decode back."""
    spec, _, _ = trained
    docs = [make_text(500, seed=s) for s in range(20)]
    (tmp_path / "docs.txt").write_text("\n\n".join(docs))
    args = ["--input", str(tmp_path / "docs.txt"), f"--out_dir={tmp_path / 'data'}", f"--tokenizer={spec['path']}"]
    corpus.main(
        [*args, "--txt_separator=\\n\\n", "--shuffle_buffer=0", "--val_tokens=100", "--test_tokens=0", "--workers=1"]
    )
    ids = np.concatenate([token_files.read(p) for p in token_files.split_paths(str(tmp_path / "data"), "train")])
    _, decode = tokenizer.load(spec)
    pieces = [decode(list(d)) for d in np.split(ids, np.flatnonzero(ids == 0) + 1) if len(d)]
    assert pieces[-1] == docs[-1] and ids[-1] == 0


ERRORS = {  # id: (the arguments, A standing for a 10-line text file; what the message holds)
    "no-source": (["--vocab_size=300"], "pass exactly one source"),
    "two-sources": (["--input", "A", "--dataset=x/y", "--vocab_size=300"], "exactly one source"),
    "vocab-below-the-bytes-and-reserved": (["--input", "A", "--vocab_size=200"], "use at least 262"),
    "missing-input": (["--input", "nope.txt", "--vocab_size=300"], "does not exist"),
    "held-out-past-the-text": (["--input", "A", "--vocab_size=300"], "lower --val_chars"),
    "no-vocab-size": (["--input", "A"], "--vocab_size"),
}


@pytest.mark.parametrize("argv, message", ERRORS.values(), ids=ERRORS)
def test_errors(tmp_path, argv, message):
    (tmp_path / "a.txt").write_text("some text\n" * 10)
    paths = {"A": str(tmp_path / "a.txt"), "nope.txt": str(tmp_path / "nope.txt")}
    with pytest.raises(UserError) as e:
        train_tokenizer.main([*(paths.get(a, a) for a in argv), f"--out_dir={tmp_path}"])
    assert message in str(e.value) and "\n" not in str(e.value), argv
