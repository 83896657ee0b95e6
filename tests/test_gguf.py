"""hf.py --format=gguf against llama.cpp itself (llama-cpp-python, built from source by make test):
its ids, logits, greedy tokens and chat replies are ours; and the refusals."""

import json
import pickle
import random
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import (
    CONVERSATIONS,
    LLAMA3_SPECIALS,
    TINY,
    chat_demo_copy,
    make_text,
    make_trained_tokenizer,
    needs,
    one_line_error,
    save_checkpoint,
    tiny_args,
)
from processes import load_script, run_python, run_script
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from data import corpus
from gpt.data import tokenizer
from gpt.data.chat_template import Template
from gpt.outdir import checkpoint
from gpt.weights import gguf_export
from model import GPT, GPTConfig

needs("gguf")


def llama_cpp(function, *args, timeout=240):
    """In a process of its own: llama.cpp can die of a signal, which then fails this test, not pytest."""
    needs("llama-cpp-python")
    with tempfile.TemporaryDirectory() as tmp:
        arguments, result = Path(tmp) / "args.pickle", Path(tmp) / "result.pickle"
        arguments.write_bytes(pickle.dumps(args))
        try:
            done = run_python(
                [Path(__file__).with_name("llama_cpp_child.py"), function, arguments, result], timeout=timeout
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"llama.cpp's {function} gave no result in {timeout} s: killed", pytrace=False)
        if done.returncode:
            code = done.returncode
            cause = f"died of {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            pytest.fail(f"llama.cpp's {function} {cause}:\n{done.stderr[-3000:]}", pytrace=False)
        return pickle.loads(result.read_bytes())


def export(out_dir, *args):
    result = run_script("hf.py", f"--out_dir={out_dir}", "--format=gguf", *args)
    assert result.returncode == 0, result.stderr
    return result


UNMERGED = " 東京都"  # one piece of GPT-4's pattern, which llama3_like makes a token that no merge reaches
USER_DEFINED = "[[note]]"  # an added token that is not special (llama.cpp: user-defined)


def llama3_like(path):
    """As in Llama 3's own file: ignore_merges on, and a token its merges never make (UNMERGED)."""
    tok = load_script("data/train_tokenizer.py").new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([make_text(20000, seed=3)], trainer)
    j = json.loads(tok.to_str())
    j["model"]["ignore_merges"] = True
    ((spelled, _),) = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(UNMERGED)
    j["model"]["vocab"][spelled] = len(j["model"]["vocab"])
    tok = Tokenizer.from_str(json.dumps(j))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS])
    tok.add_tokens([AddedToken(USER_DEFINED, special=False, normalized=False)])  # matched whole, not special
    tok.save(str(path))
    return path


# ---------------------------------------------------------------------------- tokenization

SCRIPTS = "hello Zürich naïve Москва Ελλάδα 東京都 日本語の文 서울 العربية עברית हिन्दी ภาษาไทย e\u0301 ǅemal ﬁne İstanbul ß Ωmega".split()
EMOJI = ["🙂", "👩‍👩‍👧", "👍🏽", "🇫🇷", "❤️", "🤖", "✨"]
SPACES = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\t \t", "    \n"]
PUNCT = """. , !? ... 's 'LL 've 're 'd 'M ( ) " -- # $ % _ /* ::""".split()


def random_text(rng, specials):
    kinds = [  # (the cumulative chance, a piece of that kind)
        (0.3, lambda: rng.choice(SCRIPTS + ["the", "King", "queen", "LOVE", "a"])),
        (0.45, lambda: "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 12)))),
        (0.65, lambda: rng.choice(SPACES)),
        (0.75, lambda: rng.choice(EMOJI)),
        (0.9, lambda: rng.choice(PUNCT)),
        (1.0, lambda: rng.choice(specials)),
    ]
    pieces = []
    for _ in range(rng.randint(1, 30)):
        kind = rng.random()
        pieces.append(next(piece for chance, piece in kinds if kind < chance)())
    return "".join(pieces)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    (root / "trained").mkdir()
    return {
        "gpt2": tokenizer.make_spec("gpt2"),
        "trained": tokenizer.make_spec(str(make_trained_tokenizer(root / "trained"))),
        "llama3": tokenizer.make_spec(str(llama3_like(root / "llama3.json"))),
    }


@pytest.mark.process
@pytest.mark.parametrize("kind,pre", [("gpt2", "gpt-2"), ("trained", "dbrx"), ("llama3", "llama-bpe")])
def test_llama_cpp_tokenizes_text_and_the_chat_template_to_our_ids(tokenizers, tmp_path, kind, pre):
    """One GGUF with the chat template (GPT-2's: its four turn tokens after the 50,257), loaded twice."""
    template = Template(tokenizers[kind])
    spec = {**tokenizers[kind], "vocab_size": template.vocab_size, "chat": template.meta()}
    model = GPT(GPTConfig(**dict(TINY, n_layer=1, n_head=1, block_size=32, vocab_size=template.vocab_size)))
    gguf_export.write(model, spec, str(tmp_path / "model.gguf"), "gpt2")
    encode, _ = tokenizer.load(tokenizers[kind])
    specials = {
        "gpt2": ["<|endoftext|>"],
        "trained": ["<|endoftext|>", "<|user|>", "<|end|>", "<|assistant|>"],
        "llama3": ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", USER_DEFINED],
    }[kind]
    rng = random.Random(kind)
    texts = [random_text(rng, specials) for _ in range(300)]
    theirs = llama_cpp("tokenize", tmp_path / "model.gguf", texts)
    assert theirs["metadata"]["tokenizer.ggml.pre"] == pre
    assert (theirs["bos"], theirs["eos"]) == (template.id["bos"], template.end_id)
    assert theirs["metadata"]["tokenizer.ggml.eot_token_id"] == str(template.end_id)
    wrong = [(t, encode(t), ids) for t, ids in zip(texts, theirs["ids"])]
    wrong = [w for w in wrong if w[1] != w[2]]
    assert not wrong, f"{len(wrong)} of 300 differ, e.g. {wrong[:3]}"
    assert sum(len(encode(t)) for t in texts) > 3000  # the strings are not trivially short
    if kind == "llama3":  # ignore_merges: the piece that is a token is read whole on both sides
        assert llama_cpp("tokenize", tmp_path / "model.gguf", [UNMERGED], False)["ids"] == [encode(UNMERGED)]
        assert len(encode(UNMERGED)) == 1
    prompts = [m[:n] for m in CONVERSATIONS for n in range(1, len(m) + 1) if m[n - 1]["role"] != "assistant"]
    rendered = llama_cpp("render_and_tokenize", tmp_path / "model.gguf", prompts)
    for prompt, ids in zip(prompts, rendered, strict=True):
        assert ids == template.render(prompt, add_generation_prompt=True)[0], (kind, prompt)


# ---------------------------------------------------------------------------- logits and greedy tokens

LLAMA3_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
SHAPES = {  # train.py flags: GPT-2's block without biases (zeros in the file), and a Llama with GQA and RoPE scaling
    "gpt2": dict(bias=False),
    "llama": dict(pos_encoding="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=1, bias=False, tie_embeddings=False)
    | dict(rope_scaling=json.dumps(LLAMA3_SCALING)),
}
BLOCK = 96


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """{shape: out_dir}, exported at each dtype: on BPE data, as GGUF holds no character vocabulary."""
    root = tmp_path_factory.mktemp("trained")
    (root / "text.txt").write_text(make_text(40000, seed=4) + "\nZürich 東京 🙂 1234567 naïve\n")
    tokenizers = {"gpt2": "gpt2", "llama": str(llama3_like(root / "llama3.json"))}
    runs = {}
    for shape, overrides in SHAPES.items():
        data, out = root / f"data_{shape}", root / f"out_{shape}"
        prepare = ["--input", str(root / "text.txt"), f"--out_dir={data}", f"--tokenizer={tokenizers[shape]}"]
        corpus.main([*prepare, "--txt_separator=\\n", "--val_tokens=2000", "--test_tokens=0", "--workers=1"])
        # one row a step: the gpt2 shape's step is mostly its 50,304-token vocabulary's logits and their
        # log-softmax (0.52 s a step at 4 rows of 96 on this CPU); 20 steps of one row move every weight off its init
        steps = dict(block_size=BLOCK, batch_size=1, max_iters=20, lr_decay_iters=20, eval_interval=20)
        result = run_script("train.py", *tiny_args(data, out, **steps, **overrides))
        assert result.returncode == 0, result.stderr
        for dtype in gguf_export.DTYPES:
            (out / dtype).mkdir()
            export(out, f"--gguf_dtype={dtype}", f"--export_dir={out / dtype}")
        runs[shape] = out
    return runs


def ggml_gelu(x, approximate="none"):
    """llama.cpp's CPU GELU (ggml-cpu's vec.h): tanh's, from a float16-indexed float16 table; 0 below -10, x above 10."""
    y = EXACT_GELU(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10, 0.0, torch.where(x >= 10, x, y))


EXACT_GELU = torch.nn.functional.gelu


def ours(out_dir):
    model, spec = checkpoint.load_model(str(out_dir), report=lambda _: None)
    return model.eval(), spec


@pytest.mark.process
@pytest.mark.parametrize("shape", SHAPES)
def test_llama_cpp_logits_and_greedy_tokens_are_ours(trained, shape, monkeypatch):
    """The tolerance, 1e-5 of the logits' largest magnitude: both sides compute in float32 and differ in the
    order of their sums (about 1e-6 measured: BENCHMARKS.md). llama.cpp's GELU is its own (ggml_gelu): the
    gpt2 logits are held to it against ours with that GELU, and to 4 times the GELU's effect against ours."""
    model, spec = ours(trained[shape])
    encode, _ = tokenizer.load(spec)
    ids = encode(make_text(2000, seed=11))[:BLOCK]
    prompt = ids[:16]
    scores, greedy = llama_cpp("scores_and_greedy", trained[shape] / "f32" / "model.gguf", ids, prompt, BLOCK)
    theirs = torch.from_numpy(scores)
    n_vocab = theirs.shape[-1]
    with torch.no_grad():
        logits = model(torch.tensor([ids]), logits_at="all")[0][0, :, :n_vocab]
        scale = logits.abs().max().item()
        tol = 1e-5 * scale
        diff = (theirs - logits).abs().max().item()
        if shape == "gpt2":
            monkeypatch.setattr(torch.nn.functional, "gelu", ggml_gelu)
            emulated = model(torch.tensor([ids]), logits_at="all")[0][0, :, :n_vocab]
            monkeypatch.undo()
            gelu_effect = (emulated - logits).abs().max().item()
            print(
                f"gpt2 f32: max |llama.cpp - ours| {diff:.2e}, - ours with ggml's GELU "
                f"{(theirs - emulated).abs().max().item():.2e}, ggml's GELU alone {gelu_effect:.2e} (logits up to {scale:.1f})"
            )
            torch.testing.assert_close(theirs, emulated, rtol=0, atol=tol)
            assert diff <= 4 * gelu_effect + tol
        else:
            print(f"llama f32: max |llama.cpp - ours| {diff:.2e} (logits up to {scale:.1f})")
            torch.testing.assert_close(theirs, logits, rtol=0, atol=tol)
        our_tokens = list(prompt)  # greedy by hand, without a cache
        for _ in range(64):
            our_tokens.append(int(model(torch.tensor([our_tokens]))[0][0, -1, :n_vocab].argmax()))
    assert greedy == our_tokens[len(prompt) :]
    for dtype in ("f16", "q8_0"):  # reported, not asserted
        scores, their_ids = llama_cpp("scores_and_greedy", trained[shape] / dtype / "model.gguf", ids, prompt, BLOCK)
        d = (torch.from_numpy(scores) - logits).abs().max().item()
        same_argmax = (torch.from_numpy(scores).argmax(-1) == logits.argmax(-1)).float().mean()
        agree = next((i for i, (a, b) in enumerate(zip(their_ids, greedy)) if a != b), 64)
        print(
            f"{shape} {dtype}: max |logit diff| {d:.2e} ({d / scale:.1e} of the range), argmax agrees at "
            f"{same_argmax:.1%} of positions, greedy tokens identical for the first {agree} of 64"
        )
    # q8_0 with llama.cpp's weight repacking off (no AMX buffer: the workaround for AMX CPUs) runs,
    # computes what the default load computes, and stays near our logits (q8_0 rounds each weight to
    # 1/127 of its block's largest: about 1% of the logits' range, measured)
    no_repack, _ = llama_cpp("scores_and_greedy", trained[shape] / "q8_0" / "model.gguf", ids, prompt, BLOCK, 0, True)
    torch.testing.assert_close(torch.from_numpy(no_repack), torch.from_numpy(scores), rtol=0, atol=1e-3 * scale)
    assert (torch.from_numpy(no_repack) - logits).abs().max().item() < 0.05 * scale


# ---------------------------------------------------------------------------- chat


@pytest.fixture(scope="module")
def chat_demo(tmp_path_factory, shared_chat_demo):
    out, heldout = chat_demo_copy(shared_chat_demo, tmp_path_factory.mktemp("chat_demo") / "out")
    export(out)
    single_turn = [c for c in heldout if c["intent"] != "recall"][:20]  # chat.py --prompt asks one message
    return out, single_turn


@pytest.mark.process
def test_create_chat_completion_answers_what_chat_py_answers(chat_demo):
    out_dir, conversations = chat_demo
    model, spec = ours(out_dir)
    template = Template(spec)
    asked = [c["messages"][:-1] for c in conversations]  # the system message (if any) and the user's
    theirs = llama_cpp("chat_replies", out_dir / "model.gguf", asked)
    assert theirs["eos"] == template.end_id and theirs["metadata"]["tokenizer.ggml.pre"] == "dbrx"
    right = 0
    for c, messages, prompt, reply in zip(conversations, asked, theirs["prompts"], theirs["replies"], strict=True):
        assert prompt == template.render(messages, add_generation_prompt=True)[0]
        system = [f"--system={m['content']}" for m in messages if m["role"] == "system"]
        prompt_flags = [*system, f"--prompt={messages[-1]['content']}", "--temperature=0"]
        result = run_script("chat.py", f"--out_dir={out_dir}", "--device=cpu", *prompt_flags)
        assert result.returncode == 0, result.stderr
        assert result.stdout == reply + "\n", (messages, reply)
        right += reply == c["messages"][-1]["content"]
    print(f"chat: 20 of 20 replies identical; {right} of 20 are the held-out answer")


# ---------------------------------------------------------------------------- refusals


def assert_refused(out_dir, named, *args):
    before = sorted(p.name for p in out_dir.iterdir())
    one_line_error(run_script("hf.py", f"--out_dir={out_dir}", "--format=gguf", *args), named)
    assert sorted(p.name for p in out_dir.iterdir()) == before


LLAMA_QK_NORM = dict(pos_encoding="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True)


REFUSED = {  # id: (options, None for conftest's tiny_run: a character-level model; tokenizer change; flags; message)
    "char-vocabulary": (None, None, [], "character-level vocabulary"),
    "qk_norm": (LLAMA_QK_NORM, None, [], "its llama its qk_norm=True"),
    "gqa-learned": (
        dict(n_kv_head=1),
        None,
        [],
        "GGUF's gpt2 cannot hold its n_kv_head=1, nor its llama its pos_encoding='learned'",
    ),
    "rmsnorm": (dict(norm="rmsnorm"), None, [], "GGUF's gpt2 cannot hold its norm='rmsnorm'"),
    # tokenizers llama.cpp splits otherwise
    "prefix-space": ({}, "prefix_space", [], "pre-tokenizer ByteLevel(add_prefix_space=True)"),
    "whitespace": ({}, "whitespace", [], "pre-tokenizer Whitespace"),
    "normalizer": ({}, "normalizer", [], "normalizer NFKC"),
    # bad options
    "q4_0": (None, None, ["--gguf_dtype=q4_0"], "gguf_dtype='q4_0' is not one of"),
    "onnx": (None, None, ["--format=onnx"], "format='onnx' is not one of"),
    "export_dir": (None, None, ["--export_dir={out}/ckpt.pt/gguf"], "cannot create export_dir"),
}


@pytest.mark.parametrize("options, change, args, named", REFUSED.values(), ids=list(REFUSED))
def test_what_gguf_cannot_hold_is_refused(request, tmp_path, options, change, args, named):
    if options is None:
        out_dir = request.getfixturevalue("tiny_run")
    else:
        spec = tokenizer.make_spec("gpt2")
        if change:  # a BPE tokenizer.json with a change llama.cpp cannot follow
            tok = Tokenizer(models.BPE())
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=change == "prefix_space")
            if change == "whitespace":
                tok.pre_tokenizer = pre_tokenizers.Whitespace()
            if change == "normalizer":
                tok.normalizer = normalizers.NFKC()
            tok.decoder = decoders.ByteLevel()
            alphabet = pre_tokenizers.ByteLevel.alphabet()
            trainer = trainers.BpeTrainer(
                vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False, initial_alphabet=alphabet
            )
            tok.train_from_iterator([make_text(5000, seed=2)], trainer)
            tok.save(str(tmp_path / "tokenizer.json"))
            spec = tokenizer.make_spec(str(tmp_path / "tokenizer.json"))
        model = GPT(GPTConfig(**dict(TINY, n_layer=1, vocab_size=spec["vocab_size"], **options)))
        out_dir = save_checkpoint(tmp_path / "out", model, spec)
    assert_refused(out_dir, named, *(arg.format(out=out_dir) for arg in args))


@pytest.mark.parametrize(
    "failure", [OSError(28, "No space left on device"), KeyboardInterrupt()], ids=["disk-full", "ctrl-c"]
)
def test_a_failed_write_leaves_the_old_file_whole(tmp_path, monkeypatch, failure):
    import gguf

    spec = tokenizer.make_spec("gpt2")
    model = GPT(GPTConfig(**dict(TINY, n_layer=1, vocab_size=50257)))
    out_dir = save_checkpoint(tmp_path / "out", model, spec)
    export(out_dir)
    old = (out_dir / "model.gguf").read_bytes()

    def fail_half_way(self, *args, **kwargs):
        self.fout[0].write(b"\0" * 4096)  # some bytes reach the file first
        raise failure

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail_half_way)
    out_dir_files = sorted(p.name for p in out_dir.iterdir())
    if isinstance(failure, OSError):
        assert_refused(out_dir, "No space left on device")
    else:
        with pytest.raises(KeyboardInterrupt):
            gguf_export.write(model, spec, str(out_dir / "model.gguf"), "gpt2")
    assert sorted(p.name for p in out_dir.iterdir()) == out_dir_files
    assert (out_dir / "model.gguf").read_bytes() == old


@pytest.mark.parametrize("amx", [True, False])
def test_a_q8_0_export_on_an_amx_cpu_says_how_to_load_it(tmp_path, monkeypatch, capsys, amx):
    """llama.cpp's AMX path crashes on q8_0, and f16 never takes it."""
    import hf

    model = GPT(GPTConfig(**dict(TINY, n_layer=1, vocab_size=50257)))
    out_dir = save_checkpoint(tmp_path / "out", model, {"kind": "tiktoken", "name": "gpt2", "vocab_size": 50257})
    monkeypatch.setattr(gguf_export, "cpu_has_amx", lambda: amx)
    for dtype in ("q8_0", "f16"):
        hf.main([f"--out_dir={out_dir}", "--format=gguf", f"--gguf_dtype={dtype}"])
        said = capsys.readouterr().out
        warned = "warning: this CPU has AMX" in said and "--no-repack" in said
        assert warned == (amx and dtype == "q8_0"), said
