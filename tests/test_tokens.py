"""The token-file format (gpt/data/token_files.py): header, uint16/uint32, nanoGPT files, splits over
shards, windows across shard boundaries, the vocabulary check, and the errors."""

import struct

import numpy as np
import pytest
import torch
from conftest import CPU, one_line_error, tiny_args
from processes import run_script

import train
from configurator import UserError
from gpt.data import token_files
from gpt.data.batches import get_batch, load_split


def write_shards(data_dir, split, ids, sizes):
    """ids cut into shards of the given sizes: <split>_000000.bin, ..."""
    data_dir.mkdir(exist_ok=True)
    bounds = np.cumsum([0] + sizes)
    assert bounds[-1] == len(ids)
    for i in range(len(sizes)):
        token_files.write(str(data_dir / f"{split}_{i:06d}.bin"), ids[bounds[i] : bounds[i + 1]])


def refused(call, *fragments):
    """call() raises a UserError (what the command prints as its one line), of one line holding each fragment."""
    with pytest.raises(UserError) as e:
        call()
    assert "\n" not in str(e.value) and all(fragment in str(e.value) for fragment in fragments), str(e.value)


# ---------------------------------------------------------------------------- one file


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_write_then_read(tmp_path, dtype):
    ids = np.random.default_rng(0).integers(0, np.iinfo(dtype).max, size=1000, dtype=np.int64).astype(dtype)
    path = str(tmp_path / "x.bin")
    token_files.write(path, ids)
    raw = open(path, "rb").read()
    # the header, byte by byte: magic, version 1, bytes per token, count; then the ids, little-endian
    assert raw[:8] == b"GPTTOKEN"
    assert struct.unpack("<IIQQ", raw[8:32]) == (1, np.dtype(dtype).itemsize, 1000, ids.max())
    assert raw[32:] == ids.astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    read = token_files.read(path)
    assert read.dtype == dtype and isinstance(read, np.memmap)
    np.testing.assert_array_equal(read, ids)
    assert not (tmp_path / "x.bin.tmp").exists()


def test_dtype_for_vocab_size():
    assert token_files.dtype_for(65) == token_files.dtype_for(50257) == token_files.dtype_for(65536) == np.uint16
    assert token_files.dtype_for(65537) == token_files.dtype_for(128256) == np.uint32


def header(version=1, itemsize=2, count=10):
    return struct.pack("<8sIIQQ", b"GPTTOKEN", version, itemsize, count, 0)


def test_damaged_files_are_one_line_errors(tmp_path):
    cases = {  # file: (its bytes, what its message names besides it)
        "interrupted.bin": (header() + bytes(12), ("10 tokens (52 bytes)", "has 44 bytes", "truncated")),
        "too_long.bin": (header() + bytes(40), ("10 tokens", "72 bytes")),
        "version2.bin": (header(version=2, count=1) + bytes(2), ("version 2",)),
        "3_byte.bin": (header(itemsize=3, count=1) + bytes(3), ("3-byte",)),
        "cut_header.bin": (b"GPTTOKEN\x01\x00", ("cut off inside its header",)),
        "odd.bin": (bytes(7), ("odd size",)),  # headerless but not uint16
    }
    for name, (content, fragments) in cases.items():
        (tmp_path / name).write_bytes(content)
        refused(lambda: token_files.read(str(tmp_path / name)), name, *fragments)


# ---------------------------------------------------------------------------- splits


def test_split_over_shards_reads_as_one_sequence(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) * 7 % 65521
    write_shards(tmp_path, "train", ids, [300, 1, 299, 400])
    data = token_files.Tokens.open(str(tmp_path), "train")
    assert len(data) == 1000 and data.memmapped and data.dtype == np.uint16
    for a, b in [(0, 1000), (250, 350), (299, 302), (300, 301), (10, 10), (990, 2000), (-5, None)]:
        np.testing.assert_array_equal(data[a:b], ids[a:b])
    windows = np.array([0, 295, 299, 300, 301, 598, 983])[:, None] + np.arange(17)  # (B, T+1), several across shards
    np.testing.assert_array_equal(data[windows], ids[windows])
    ram = data.in_ram()
    assert not ram.memmapped and len(ram.parts) == 1
    np.testing.assert_array_equal(ram[windows], ids[windows])
    # train.py's batches read the same windows from shards as from one array
    x, y = get_batch(data, windows[:, 0], 16, CPU)
    x1, y1 = get_batch(ids, windows[:, 0], 16, CPU)
    assert torch.equal(x, x1) and torch.equal(y, y1)
    with pytest.raises(IndexError):
        data[np.array([1000])]


def test_load_split_modes_give_the_same_tokens(tmp_path):
    ids = np.random.default_rng(1).integers(0, 100_000, size=3000).astype(np.uint32)
    write_shards(tmp_path, "val", ids, [1000, 1000, 1000])
    for mode in ("ram", "memmap", "auto"):
        data = load_split(str(tmp_path), "val", mode)
        assert data.dtype == np.uint32
        np.testing.assert_array_equal(np.asarray(data), ids)
    assert not load_split(str(tmp_path), "val", "ram").memmapped
    assert load_split(str(tmp_path), "val", "memmap").memmapped


def test_split_errors(tmp_path):
    refused(lambda: token_files.Tokens.open(str(tmp_path), "train"), "train.bin not found", "prepare.py")
    write_shards(tmp_path, "train", np.arange(30, dtype=np.uint16), [10, 10, 10])
    (tmp_path / "train_000001.bin").unlink()
    refused(lambda: token_files.Tokens.open(str(tmp_path), "train"), "train_000001.bin", "again")
    np.arange(5, dtype=np.uint16).tofile(tmp_path / "train.bin")
    refused(lambda: token_files.Tokens.open(str(tmp_path), "train"), "both train.bin and train_000000.bin")
    token_files.write(str(tmp_path / "val.bin"), np.zeros(0, np.uint16))
    refused(lambda: token_files.Tokens.open(str(tmp_path), "val"), "empty")


def test_vocab_check_names_the_file_and_the_id(tmp_path, monkeypatch):
    monkeypatch.setattr(token_files, "CHECK_CHUNK", 64)  # several chunks per shard
    ids = np.random.default_rng(2).integers(0, 1000, size=900).astype(np.uint32)
    ids[650] = 1000
    write_shards(tmp_path, "train", ids, [300, 300, 300])
    mapped = token_files.Tokens.open(str(tmp_path), "train")
    for data in (mapped, mapped.in_ram()):
        data.check_vocab(1001)  # 1000 is a valid id of a 1001-token vocabulary
        fragments = ("train_000002.bin", "token id 1000", "token 50 of the file", "vocab_size is 1000")
        refused(lambda: data.check_vocab(1000), *fragments)


def test_the_header_max_id_spares_reading_the_ids(tmp_path):
    ids = np.arange(500, dtype=np.uint32)
    write_shards(tmp_path, "train", ids, [250, 250])
    data = token_files.Tokens.open(str(tmp_path), "train")
    assert data.max_ids == [249, 499]

    class Unreadable(np.ndarray):
        def __getitem__(self, key):
            raise AssertionError("the vocabulary check read token ids")

    data.parts = [p.view(Unreadable) for p in data.parts]
    data.check_vocab(500)  # the headers say 499 is the largest id
    with pytest.raises(AssertionError):
        data.check_vocab(499)  # a header over the limit: the ids are read to name the bad one


def test_uint16_data_passes_any_vocab_above_its_range():
    data = token_files.Tokens(["x.bin"], [np.full(10, 65535, np.uint16)])
    data.check_vocab(65536)
    with pytest.raises(UserError):
        data.check_vocab(65535)


# ---------------------------------------------------------------------------- train.py


def test_train_stops_on_a_token_beyond_the_vocabulary(char_data, tmp_path):
    """A character dataset whose val split holds an id past its 65-character vocabulary: one
    line naming the file before any step, and nothing written to out_dir."""
    val = np.fromfile(char_data / "val.bin", dtype=np.uint16)
    val[100] = 70
    val.tofile(char_data / "val.bin")
    out_dir = tmp_path / "out"
    result = run_script("train.py", *tiny_args(char_data, out_dir))
    one_line_error(result, "val.bin", "token id 70", "vocab_size is")
    assert result.returncode == 2 and not out_dir.exists()


def test_train_reads_sharded_uint32_data_and_stops_on_a_truncated_shard(tmp_path):
    """Sharded data in the new format trains; cutting a shard short is a one-line error."""
    data_dir = tmp_path / "d"
    rng = np.random.default_rng(3)
    write_shards(data_dir, "train", rng.integers(0, 70_000, size=3000).astype(np.uint32), [1000, 1000, 1000])
    write_shards(data_dir, "val", rng.integers(0, 70_000, size=500).astype(np.uint32), [500])
    (data_dir / "meta.json").write_text('{"kind": "tiktoken", "name": "gpt2", "vocab_size": 70000}')
    args = tiny_args(data_dir, tmp_path / "out", max_iters=2, eval_interval=2, eval_iters=1, n_embd=16, n_head=1)
    assert train.main(args) == 0
    shard = data_dir / "train_000001.bin"
    shard.write_bytes(shard.read_bytes()[:-4])
    # the same out_dir, which now holds the first run: replacing it is meant
    refused(lambda: train.main([*args, "--overwrite=True"]), "train_000001.bin", "truncated")
