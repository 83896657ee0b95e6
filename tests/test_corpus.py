"""The preparation routine (data/corpus.py) on local corpora, against a plain reference tokenization."""

import hashlib
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import make_128k_tokenizer, make_text, needs, one_line_error, tiny_args
from processes import run_script

import sample
import train
from configurator import UserError
from data import corpus
from gpt.data import token_files, tokenizer
from gpt.data.batches import load_split

EOT = 50256


def make_docs(n, seed):
    """n distinct documents of 20 to 2,500 characters, a few of them awkward."""
    rng = np.random.default_rng(seed)
    docs = [f"{seed}.{i} " + make_text(int(rng.integers(20, 2500)), seed=seed * 10_000 + i) for i in range(n)]
    docs[3] = f"{seed}: naïve café, 東京 🙂 and <|endoftext|> in the middle of a document"
    docs[7] = "   \n "  # blank: skipped, not a lone end-of-text
    return docs


@pytest.fixture(scope="module")
def corpus_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    a, b, c = make_docs(200, 1), make_docs(100, 2), make_docs(100, 3)  # ~150,000 tokens
    (root / "a.jsonl").write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(a)))
    pq.write_table(pa.table({"text": b, "n": list(range(len(b)))}), root / "b.parquet")
    (root / "c.txt").write_text("\n\n".join(c), encoding="utf-8")
    files = [str(root / "a.jsonl"), str(root / "b.parquet"), str(root / "c.txt")]
    return files, [d for d in a + b + c if d.strip()]


def prepare(out_dir, files, *flags, **options):  # in one process unless asked: a pool costs its workers' startup
    defaults = dict(val_tokens=3000, test_tokens=2000, shard_tokens=20_000, workers=1, txt_separator="\\n\\n")
    options = {**defaults, **options}
    argv = ["--input", *map(str, files), f"--out_dir={out_dir}", *flags, *(f"--{k}={v}" for k, v in options.items())]
    return corpus.main(argv)


def reference_splits(docs, val, test, train_tokens=None):
    """A split stops at its size, dropping the rest of the document it cut."""
    enc = tokenizer.encoding("gpt2")
    stream = [enc.encode_ordinary(d) + [EOT] for d in docs]
    out, i = {}, 0
    for split, quota in (("val", val), ("test", test), ("train", train_tokens)):
        ids = []
        while i < len(stream) and (quota is None or len(ids) < quota):
            ids += stream[i][: None if quota is None else quota - len(ids)]
            i += 1
        out[split] = np.array(ids)
    return out, sum(map(len, stream))


def read_split(out_dir, split):
    return np.asarray(token_files.Tokens.open(str(out_dir), split))


def file_hashes(out_dir):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out_dir.iterdir())}


def documents_of(ids):
    cuts = np.flatnonzero(ids == EOT)
    return [tuple(d) for d in np.split(ids[: cuts[-1] + 1], cuts[:-1] + 1)] if len(cuts) else []


# ---------------------------------------------------------------------------- what is written


@pytest.mark.parametrize("tokens", [None, 50_000], ids=["everything", "a-token-budget"])
def test_splits_equal_a_plain_tokenization_and_a_second_run_does_nothing(corpus_files, tmp_path, capsys, tokens):
    files, docs = corpus_files
    budget = {} if tokens is None else {"tokens": tokens}
    assert prepare(tmp_path, files, shuffle_buffer=0, **budget) == 0
    expected, total = reference_splits(docs, 3000, 2000, tokens and tokens - 3000 - 2000)
    for split in ("val", "test", "train"):
        np.testing.assert_array_equal(read_split(tmp_path, split), expected[split])
    if tokens is None:
        # the token total is every document's ids plus its end-of-text, less the two cut-off remainders
        dropped = total - sum(len(v) for v in expected.values())
        assert 0 < dropped < 2 * 2500 and len(expected["val"]) == 3000 and len(expected["test"]) == 2000
    else:
        assert sum(token_files.read_header(str(p))[1] for p in tmp_path.glob("*.bin")) == tokens
    # shards: full ones of 20,000 tokens, then the rest
    n_train = len(expected["train"])
    shards = sorted(p.name for p in tmp_path.glob("train_*.bin"))
    assert shards == [f"train_{i:06d}.bin" for i in range(-(-n_train // 20_000))]
    sizes = [token_files.read_header(str(tmp_path / s))[1] for s in shards]
    assert sizes == [20_000] * (len(shards) - 1) + [n_train % 20_000]
    assert sorted(p.name for p in tmp_path.glob("va*")) == ["val_000000.bin"]
    assert token_files.read_header(str(tmp_path / shards[0]))[0] == np.uint16
    # the data directory says what it is, and train.py reads it
    assert tokenizer.describe(str(tmp_path)) == {"kind": "tiktoken", "name": "gpt2", "vocab_size": 50257}
    assert len(load_split(str(tmp_path), "train", "memmap")) == n_train
    assert json.loads((tmp_path / "prepare.json").read_text())["done"] is True
    before = file_hashes(tmp_path)
    capsys.readouterr()
    prepare(tmp_path, files, shuffle_buffer=0, **budget)  # done: nothing to do
    assert "already prepared" in capsys.readouterr().out
    assert file_hashes(tmp_path) == before


def test_shuffled_splits_hold_whole_distinct_documents(corpus_files, tmp_path):
    files, docs = corpus_files
    enc = tokenizer.encoding("gpt2")
    encoded = {tuple(enc.encode_ordinary(d) + [EOT]) for d in docs}
    prepare(tmp_path / "a", files, seed=1, shuffle_buffer=100, workers=2)
    seen = {}
    for split in ("val", "test", "train"):
        for doc in documents_of(read_split(tmp_path / "a", split)):
            assert doc in encoded  # a whole input document, nothing else
            assert doc not in seen, f"a document in {seen.get(doc)} and {split}"
            seen[doc] = split
    assert len(docs) - 2 <= len(seen) <= len(docs)  # every document but the (up to) two cut at a split's end
    prepare(tmp_path / "b", files, seed=1, shuffle_buffer=100, workers=1)  # workers do not change a byte
    assert file_hashes(tmp_path / "a") == file_hashes(tmp_path / "b")
    prepare(tmp_path / "c", files, seed=2, shuffle_buffer=100)
    assert not np.array_equal(read_split(tmp_path / "a", "val"), read_split(tmp_path / "c", "val"))


# ---------------------------------------------------------------------------- interruptions


class Crash(Exception):
    pass


def crash_before_recording(monkeypatch, n_shards, call):
    """call() dies (Crash) when prepare.json is about to record a shard past the first n_shards."""
    real_save = corpus.Progress.save

    def save_or_crash(self, *args, **kwargs):
        if sum(len(v) for v in self.state["shards"].values()) == n_shards:
            raise Crash
        real_save(self, *args, **kwargs)

    with monkeypatch.context() as patched, pytest.raises(Crash):
        patched.setattr(corpus.Progress, "save", save_or_crash)
        call()


def test_restart_after_an_interruption_writes_the_same_bytes(corpus_files, tmp_path, monkeypatch):
    files, _ = corpus_files
    flags = dict(seed=5, shard_tokens=7_000)  # small shards: most boundaries cut a document
    prepare(tmp_path / "whole", files, **flags)
    whole = file_hashes(tmp_path / "whole")
    assert len([f for f in whole if f.startswith("train_")]) > 10
    out = tmp_path / "cut"
    real_write = token_files.write

    # 1. killed while writing the 6th shard (two workers): half of it is on disk under its temporary name
    def write_then_crash(path, ids):
        if len(list(out.glob("*.bin"))) == 5:
            with open(path + ".tmp", "wb") as f:
                f.write(b"GPTTOKEN" + bytes(100))
            raise Crash
        real_write(path, ids)

    monkeypatch.setattr(token_files, "write", write_then_crash)
    with pytest.raises(Crash):
        prepare(out, files, **flags, workers=2)
    progress = json.loads((out / "prepare.json").read_text())
    assert sum(len(v) for v in progress["shards"].values()) == 5 and not progress["done"]
    assert (out / "train_000003.bin.tmp").exists()  # val, test, train 0-2 complete; train 3 half-written
    assert not (out / "train_000003.bin").exists()
    assert len(token_files.Tokens.open(str(out), "train")) == 3 * 7_000  # the loader sees only complete shards

    # 2. killed after the 9th shard was renamed into place but before prepare.json recorded it
    monkeypatch.setattr(token_files, "write", real_write)
    crash_before_recording(monkeypatch, 8, lambda: prepare(out, files, **flags, workers=2))
    assert (out / "train_000006.bin").exists()

    # 3. the same command again finishes the job, with a different number of workers
    prepare(out, files, **flags)
    assert file_hashes(out) == whole


def test_rerun_with_other_settings_or_a_damaged_shard_is_refused(corpus_files, tmp_path, monkeypatch):
    files, _ = corpus_files
    crash_before_recording(monkeypatch, 4, lambda: prepare(tmp_path, files))
    before = file_hashes(tmp_path)
    with pytest.raises(UserError) as e:
        prepare(tmp_path, files, seed=7, val_tokens=10)
    assert "other settings (val_tokens, seed)" in str(e.value)
    shard = tmp_path / "train_000001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    before[shard.name] = hashlib.sha256(shard.read_bytes()).hexdigest()
    with pytest.raises(UserError) as e:
        prepare(tmp_path, files)
    assert "train_000001.bin" in str(e.value) and "\n" not in str(e.value)
    assert file_hashes(tmp_path) == before  # nothing was touched


# ---------------------------------------------------------------------------- a 128k vocabulary


def test_128k_vocabulary_gives_uint32_files_that_train(tmp_path, capsys):
    tok_path = make_128k_tokenizer(tmp_path / "tokenizer.json")
    rng = np.random.default_rng(0)
    ids = [rng.integers(1, 128255, size=int(rng.integers(5, 60))) for _ in range(400)]
    lines = (json.dumps({"text": " ".join(f"w{i}" for i in d)}) for d in ids)
    (tmp_path / "docs.jsonl").write_text("".join(f"{line}\n" for line in lines))
    data_dir = tmp_path / "data"
    keys = dict(tokenizer=tok_path, val_tokens=500, test_tokens=0, shuffle_buffer=0, shard_tokens=4000)
    prepare(data_dir, [tmp_path / "docs.jsonl"], **keys)
    assert token_files.read_header(str(data_dir / "train_000000.bin"))[0] == np.uint32
    stream = np.concatenate([np.append(d, 128255) for d in ids])  # the word numbers are the ids
    ends = np.cumsum([len(d) + 1 for d in ids])
    train_start = ends[np.searchsorted(ends, 499, side="right")]  # after the document val's last token is in
    np.testing.assert_array_equal(read_split(data_dir, "val"), stream[:500])
    train_ids = read_split(data_dir, "train")
    np.testing.assert_array_equal(train_ids, stream[train_start:])
    assert train_ids.max() > 65535

    out_dir = tmp_path / "out"
    args = tiny_args(data_dir, out_dir, max_iters=2, eval_interval=2, eval_iters=1, n_embd=16, n_head=1)
    assert train.main(args) == 0
    state = torch.load(out_dir / "ckpt.pt", weights_only=True)
    assert state["model_args"]["vocab_size"] == 128256 and state["tokenizer"]["kind"] == "tokenizers"
    capsys.readouterr()
    sample_keys = dict(out_dir=out_dir, device="cpu", num_samples=1, max_new_tokens=4, stream=False, stop_at_eot=False)
    sample.main([*(f"--{k}={v}" for k, v in sample_keys.items()), "--start=w70000 w5"])
    text = capsys.readouterr().out.split("w70000 w5", 1)[1].split("---")[0]
    assert re.fullmatch(r"(\s*(w\d+|<\|end_of_text\|>|\[UNK\]))+\s*", text), text


# ---------------------------------------------------------------------------- measuring


def test_estimate_reports_the_mean_and_the_documents_needed(corpus_files, tmp_path, capsys):
    files, docs = corpus_files
    prepare(tmp_path, files, "--estimate=100", shuffle_buffer=0, tokens=1_000_000)
    out = capsys.readouterr().out
    enc = tokenizer.encoding("gpt2")
    lengths = [len(enc.encode_ordinary(d)) + 1 for d in docs[:100]]
    mean = float(re.search(r"100 documents: ([\d,.]+) tokens per document", out).group(1).replace(",", ""))
    median = int(re.search(r"median ([\d,]+)", out).group(1).replace(",", ""))
    needed = int(re.search(r"needs about ([\d,]+) documents", out).group(1).replace(",", ""))
    assert mean == pytest.approx(np.mean(lengths), abs=0.0501) and median == round(np.median(lengths))
    assert needed == -(-1_000_000 // np.mean(lengths))
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing written


def test_benchmark_smoke(corpus_files, tmp_path, capsys):
    files, _ = corpus_files
    prepare(tmp_path, files, "--benchmark=200", workers=2)
    rows = [line for line in capsys.readouterr().out.splitlines() if "tokens/s" in line]
    labels = [f"encode_ordinary_batch, {n} thread" for n in (1, 2)] + [f"{n} worker process" for n in (1, 2)]
    assert len(rows) == 4 and all(label in row for label, row in zip(labels, rows))
    counts = {re.search(r"\(([\d,]+) tokens in", row).group(1) for row in rows}
    assert len(counts) == 1  # every way tokenized the same documents into the same number of tokens


# ---------------------------------------------------------------------------- bad input


BAD_INPUTS = {  # id: (the input file's name, its content (a table: parquet; None: no file), flags, the message)
    "not-json": ("bad.jsonl", '{"text": "fine"}\nnot json\n', [], "bad.jsonl:2 is not a JSON object"),
    "no-text-field": ("bad.jsonl", '{"body": "x"}\n', [], "bad.jsonl:1 has no text field 'text' (it has: body)"),
    "nothing-for-train": (
        "bad.jsonl",
        '{"text": "x"}\n',
        ["--tokens=100", "--val_tokens=60", "--test_tokens=40"],
        "leaves nothing for train",
    ),
    "too-little": ("bad.jsonl", '{"text": "only a few tokens"}\n', [], "ran out after val 5 tokens"),
    "no-workers": ("bad.jsonl", '{"text": "x"}\n', ["--workers=0"], "--workers=0"),
    "tokens-fraction": ("bad.jsonl", '{"text": "x"}\n', ["--tokens=1.5"], "not a whole number"),
    "no-text-column": ("a.parquet", pa.table({"body": ["x"]}), [], "has no column 'text' (it has: body)"),
    "csv": ("a.csv", "x", [], "cannot read this kind of file"),
    "missing": ("none.txt", None, [], "none.txt does not exist"),
    # out/train.bin left there: refused before the input is read
    "another-preparation": ("a.parquet", pa.table({"body": ["x"]}), [], "holds train.bin from another preparation"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_one_line(tmp_path, case):
    name, content, flags, fragment = BAD_INPUTS[case]
    if isinstance(content, pa.Table):
        pq.write_table(content, tmp_path / name)
    elif content is not None:
        (tmp_path / name).write_text(content)
    if case == "another-preparation":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "train.bin").write_bytes(bytes(4))
    with pytest.raises(UserError) as e:
        corpus.main(["--input", str(tmp_path / name), f"--out_dir={tmp_path / 'out'}", "--workers=1", *flags])
    assert fragment in str(e.value) and "\n" not in str(e.value)
    written = sorted(p.name for p in (tmp_path / "out").iterdir()) if (tmp_path / "out").exists() else []
    # too-little runs out after writing val
    assert case == "too-little" or written == (["train.bin"] if case == "another-preparation" else [])


@pytest.mark.process
def test_unknown_dataset_without_network_is_one_line(tmp_path):
    out_dir = tmp_path / "fw"
    dataset = ["--dataset=nobody/no-such-dataset", f"--out_dir={out_dir}"]
    # datasets reads these when it is imported
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = run_script("data/fineweb_edu/prepare.py", *dataset, env=offline, isolated=True)
    one_line_error(result, "cannot reach Hugging Face for 'nobody/no-such-dataset'", "--input")
    assert result.returncode == 2 and not out_dir.exists()


def test_shakespeare_script(tmp_path):
    """data/shakespeare/prepare.py on a stand-in text: speeches in order, val first."""
    speeches = [make_text(300, seed=i) for i in range(60)]
    (tmp_path / "input.txt").write_text("\n\n".join(speeches), encoding="utf-8")
    out_dir = tmp_path / "sh"
    args = ["--input", tmp_path / "input.txt", f"--out_dir={out_dir}", "--val_tokens=1000", "--workers=1"]
    result = run_script("data/shakespeare/prepare.py", *args)
    assert result.returncode == 0, result.stderr
    expected, _ = reference_splits(speeches, 1000, 0)
    np.testing.assert_array_equal(read_split(out_dir, "val"), expected["val"])
    np.testing.assert_array_equal(read_split(out_dir, "train"), expected["train"])
    assert not list(out_dir.glob("test_*"))


def test_hub_stream_shuffles_by_seed_and_resumes(corpus_files, tmp_path, monkeypatch):
    """The Hub replaced by a local streaming dataset: the library's seeded shuffle; a restart writes the same bytes."""
    needs("datasets")
    import datasets
    import huggingface_hub

    _, docs = corpus_files
    calls = []

    def load_dataset(name, config, split, revision, streaming):
        calls.append((name, config, split, revision, streaming))
        rows = [{"text": d, "id": i} for i, d in enumerate(docs)]
        return datasets.IterableDataset.from_generator(lambda rows: iter(rows), gen_kwargs={"rows": rows})

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", lambda self, name, revision=None, timeout=None: None)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    keys = dict(dataset="some/set", name="cfg", val_tokens=3000, test_tokens=2000, shard_tokens=20000, workers=1)
    options = [f"--{k}={v}" for k, v in dict(keys, seed=3, shuffle_buffer=200).items()]
    corpus.main(options + [f"--out_dir={tmp_path / 'whole'}", "--workers=2"])  # the restart below on one
    assert calls[0] == ("some/set", "cfg", "train", None, True)
    enc = tokenizer.encoding("gpt2")
    encoded = {tuple(enc.encode_ordinary(d) + [EOT]) for d in docs}
    val_docs = documents_of(read_split(tmp_path / "whole", "val"))
    assert val_docs and set(val_docs) <= encoded
    assert val_docs[0] != tuple(enc.encode_ordinary(docs[0]) + [EOT])  # shuffled

    crash_before_recording(monkeypatch, 6, lambda: corpus.main(options + [f"--out_dir={tmp_path / 'cut'}"]))
    corpus.main(options + [f"--out_dir={tmp_path / 'cut'}"])
    assert file_hashes(tmp_path / "cut") == file_hashes(tmp_path / "whole")
