"""Text <-> token ids for the two kinds of data this trainer reads.

A tokenizer is described by a small dict that train.py stores in each checkpoint, so
sample.py can decode without the data directory:
    {"kind": "char", "chars": "\\n !$&',-.3:;?ABC..."}   character-level (data/shakespeare_char)
    {"kind": "tiktoken", "name": "gpt2"}                 GPT-2 BPE
"""

import json
import os
import pickle

from configurator import UserError


def describe(data_dir):
    """The tokenizer of a prepared data directory: its meta.json (or nanoGPT's meta.pkl)
    for character-level data, else GPT-2 BPE."""
    json_path, pkl_path = os.path.join(data_dir, "meta.json"), os.path.join(data_dir, "meta.pkl")
    if os.path.exists(json_path):
        with open(json_path, encoding="utf-8") as f:
            meta = json.load(f)
        return {"kind": "char", "chars": meta["chars"]}
    if os.path.exists(pkl_path):
        with open(pkl_path, "rb") as f:
            meta = pickle.load(f)  # written by nanoGPT's prepare.py in the user's own data dir
        itos = meta["itos"]
        return {"kind": "char", "chars": "".join(itos[i] for i in range(len(itos)))}
    return {"kind": "tiktoken", "name": "gpt2"}


def vocab_size(spec):
    return len(spec["chars"]) if spec["kind"] == "char" else None


def load(spec):
    """(encode, decode) for a tokenizer description."""
    if spec["kind"] == "char":
        stoi = {ch: i for i, ch in enumerate(spec["chars"])}

        def encode(text):
            unknown = sorted(set(text) - stoi.keys())
            if unknown:
                raise UserError(f"the prompt has characters this model never saw: {''.join(unknown)!r}")
            return [stoi[ch] for ch in text]

        return encode, lambda ids: "".join(spec["chars"][i] for i in ids)
    import tiktoken

    enc = tiktoken.get_encoding(spec["name"])
    return (lambda text: enc.encode(text, allowed_special={"<|endoftext|>"})), enc.decode
