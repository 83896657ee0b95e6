"""Data: prepare.py, batches (shift, reproducibility, resume, ranks), nanoGPT's and llm.c's data dirs, eval offsets."""

import json
import pickle

import numpy as np
import pytest
import torch
from conftest import CPU, make_text, one_line_error, read_metrics, tiny_args
from processes import load_script, run_script

from configurator import UserError
from gpt.data import tokenizer
from gpt.data.batches import TrainBatches, eval_offsets, get_batch, load_split
from gpt.device import runtime


def read_bin(path):
    return np.fromfile(path, dtype=np.uint16)


# ---------------------------------------------------------------------------- prepare.py


def test_prepare_round_trip(tmp_path):
    text = make_text(5000) + "\ncafé — naïve ¶"  # characters outside ASCII (and above 255) as well
    vocab, n_train, n_val = load_script("data/shakespeare_char/prepare.py").prepare(text, str(tmp_path))
    train_ids, val_ids = read_bin(tmp_path / "train.bin"), read_bin(tmp_path / "val.bin")
    assert (tmp_path / "train.bin").stat().st_size == 2 * len(train_ids)  # raw uint16, no header
    assert (len(train_ids), len(val_ids)) == (n_train, n_val)
    assert n_train == int(0.9 * len(text)) and n_train + n_val == len(text)
    with open(tmp_path / "meta.json", encoding="utf-8") as f:
        meta = json.load(f)
    chars = meta["chars"]
    assert chars == "".join(sorted(set(text))) and meta["vocab_size"] == len(chars) == vocab
    decoded = "".join(chars[i] for i in np.concatenate([train_ids, val_ids]))
    assert decoded == text
    # the tokenizer train.py and sample.py use reads the same vocabulary
    spec = tokenizer.describe(str(tmp_path))
    encode, decode = tokenizer.load(spec)
    assert spec == {"kind": "char", "chars": chars}
    assert encode(text) == list(np.concatenate([train_ids, val_ids]))
    assert decode(list(val_ids)) == text[n_train:]


def test_prepare_script(tmp_path):
    text_path = tmp_path / "input.txt"
    text_path.write_text(make_text(3000), encoding="utf-8")
    out_dir = tmp_path / "out"
    result = run_script("data/shakespeare_char/prepare.py", "--input", text_path, "--out_dir", out_dir)
    assert result.returncode == 0, result.stderr
    assert len(read_bin(out_dir / "train.bin")) == 2700 and len(read_bin(out_dir / "val.bin")) == 300
    assert (out_dir / "meta.json").exists()


# ---------------------------------------------------------------------------- batches


def counting_data(n=5000):
    """data[i] == i: every window says where it starts."""
    return np.arange(n, dtype=np.uint16)


def check_windows(x, y, n, block_size):
    """x, y are windows of counting_data at valid offsets, y being x shifted by one."""
    assert x.shape == y.shape and x.shape[1] == block_size
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    starts = x[:, :1]
    assert torch.equal(x, starts + torch.arange(block_size))
    assert torch.equal(y, x + 1)
    assert int(starts.min()) >= 0 and int(y.max()) <= n - 1


def test_get_batch_at_given_offsets():
    data = counting_data()
    offsets = np.array([0, 17, 4999 - 8])  # the last one ends on the final token
    x, y = get_batch(data, offsets, 8, CPU)
    check_windows(x, y, len(data), 8)
    assert x[:, 0].tolist() == offsets.tolist()


def test_train_batches_are_windows_at_random_offsets():
    data = counting_data()
    batches = TrainBatches(data, 6, 16, seed=0, rt=CPU)
    starts = set()
    for _ in range(20):
        x, y = batches()
        assert x.shape == (6, 16)
        check_windows(x, y, len(data), 16)
        starts.update(x[:, 0].tolist())
    assert len(starts) > 100  # not the same few windows over and over


def test_train_batches_reach_the_last_window():
    data = counting_data(20)
    batches = TrainBatches(data, 64, 16, seed=0, rt=CPU)
    x, y = batches()
    check_windows(x, y, len(data), 16)
    assert set(x[:, 0].tolist()) == {0, 1, 2, 3}  # all len - block_size starts, the last included


def draw(batches, n):
    return [torch.cat(batches()) for _ in range(n)]


def test_train_batches_seeded():
    data = counting_data()
    a = draw(TrainBatches(data, 4, 16, seed=1, rt=CPU), 5)
    b = draw(TrainBatches(data, 4, 16, seed=1, rt=CPU), 5)
    c = draw(TrainBatches(data, 4, 16, seed=2, rt=CPU), 5)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not all(torch.equal(u, v) for u, v in zip(a, c))


def test_train_batches_resume_from_rng_state():
    data = counting_data()
    batches = TrainBatches(data, 4, 16, seed=1, rt=CPU)
    draw(batches, 3)
    state = json.loads(json.dumps(batches.rng.bit_generator.state))  # survives a JSON round trip
    expected = draw(batches, 4)
    resumed = TrainBatches(data, 4, 16, seed=999, rt=CPU)
    resumed.rng.bit_generator.state = state
    assert all(torch.equal(u, v) for u, v in zip(expected, draw(resumed, 4)))


def test_train_batches_split_between_ranks():
    data, B = counting_data(), 3
    ranks = [
        TrainBatches(data, B, 16, seed=5, rt=runtime.Runtime("cpu", "cpu", torch.float32, rank=r, world_size=2))
        for r in range(2)
    ]
    single = TrainBatches(data, 2 * B, 16, seed=5, rt=CPU)
    for _ in range(3):
        (x0, y0), (x1, y1) = ranks[0](), ranks[1]()
        x, y = single()
        assert x0.shape == x1.shape == (B, 16)
        assert not torch.equal(x0, x1)
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)


# ---------------------------------------------------------------------------- nanoGPT-format data and load_split


@pytest.fixture
def nanogpt_data(tmp_path):
    """A data dir as nanoGPT's shakespeare_char/prepare.py leaves it: raw .bin files and meta.pkl."""
    text = make_text(4000, seed=3)
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(0.9 * len(ids))
    ids[:n].tofile(tmp_path / "train.bin")
    ids[n:].tofile(tmp_path / "val.bin")
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars), "itos": itos, "stoi": stoi}, f)
    return tmp_path, text, ids, n


def test_nanogpt_data_dir_loads(nanogpt_data):
    data_dir, text, ids, n = nanogpt_data
    assert not (data_dir / "meta.json").exists()
    spec = tokenizer.describe(str(data_dir))
    assert spec == {"kind": "char", "chars": "".join(sorted(set(text)))}
    assert tokenizer.vocab_size(spec) == len(set(text))
    _, decode = tokenizer.load(spec)
    for split, expected in (("train", ids[:n]), ("val", ids[n:])):
        ram, mapped, auto = (load_split(str(data_dir), split, mode) for mode in ("ram", "memmap", "auto"))
        assert mapped.memmapped and not ram.memmapped
        assert ram.dtype == mapped.dtype == np.uint16
        assert len(ram) == len(mapped) == len(expected)  # headerless: every byte pair is a token
        np.testing.assert_array_equal(ram, mapped)
        np.testing.assert_array_equal(ram, expected)
        np.testing.assert_array_equal(auto, expected)
    assert decode(load_split(str(data_dir), "val", "ram")[:].tolist()) == text[n:]


def write_llmc(path, ids, version=1):
    """A token file as llm.c writes one: 256 int32 (magic 20240520, version, token count), then uint16 ids."""
    header = np.zeros(256, "<i4")
    header[:3] = 20240520, version, len(ids)
    path.write_bytes(header.tobytes() + ids.astype("<u2").tobytes())


def test_llmc_shards_train_and_score_the_masked_val_and_bad_ones_are_one_line(tmp_path):
    """llm.c's shards as the speedruns download them (val 000000, train from 000001) are a dataset: train.py
    trains on it logging val_masked_loss, eval.py scores the same; a truncated, missing or other-version file is one line."""
    ids = np.random.default_rng(0).integers(0, 1000, 3000).astype(np.uint16)
    ids[::37] = 50256  # GPT-2's end-of-text: documents
    (data := tmp_path / "fineweb10B").mkdir()
    for name, part in (("val_000000", ids[:600]), ("train_000001", ids[600:1800]), ("train_000002", ids[1800:])):
        write_llmc(data / f"fineweb_{name}.bin", part)
    np.testing.assert_array_equal(load_split(str(data), "train", "memmap"), ids[600:])
    np.testing.assert_array_equal(load_split(str(data), "val"), ids[:600])
    trained = run_script("train.py", *tiny_args(data, tmp_path / "out", max_iters=4, eval_interval=2, eval_masked=True))
    assert trained.returncode == 0, trained.stderr
    masked = [r["val_masked_loss"] for r in read_metrics(tmp_path / "out") if "val_masked_loss" in r]
    assert len(masked) == 3 and masked[-1] < masked[0]  # at steps 0, 2 and 4
    eval_args = ["--device=cpu", f"--out_dir={tmp_path / 'out'}", "--checkpoint=latest", "--tasks=val_masked"]
    scored = run_script("eval.py", *eval_args, "--json=True")
    assert scored.returncode == 0, scored.stderr
    result = json.loads(scored.stdout.strip().splitlines()[-1])["val_masked"]
    assert result["tokens"] == 599 and abs(result["loss"] - masked[-1]) < 1e-5
    write_llmc(data / "fineweb_val_000000.bin", ids[:600], version=2)
    one_line_error(run_script("eval.py", *eval_args), "fineweb_val_000000.bin", "llm.c version 2")
    (data / "fineweb_train_000002.bin").write_bytes((data / "fineweb_train_000002.bin").read_bytes()[:2000])
    truncated = run_script("train.py", *tiny_args(data, tmp_path / "out2"))
    one_line_error(truncated, "fineweb_train_000002.bin", "1,200 tokens", "truncated", "download it again")
    (data / "fineweb_train_000001.bin").unlink()
    with pytest.raises(UserError, match="lacks shard fineweb_train_000001.bin"):
        load_split(str(data), "train")


# ---------------------------------------------------------------------------- eval offsets


def test_eval_offsets_deterministic_and_in_range():
    data = counting_data(40)
    a = eval_offsets(data, eval_iters=50, batch_size=8, block_size=16, seed=3)
    b = eval_offsets(data, eval_iters=50, batch_size=8, block_size=16, seed=3)
    c = eval_offsets(data, eval_iters=50, batch_size=8, block_size=16, seed=4)
    assert a.shape == (50, 8)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.min() >= 0 and a.max() <= len(data) - 16 - 1  # room for the shifted target
    assert a.max() == len(data) - 16 - 1 and a.min() == 0  # 400 draws from 24 starts reach both ends
    x, y = get_batch(data, a[0], 16, CPU)
    check_windows(x, y, len(data), 16)
