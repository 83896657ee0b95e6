"""What several test files share: the CPU runtime, the tiny shapes, data made on the spot, the runs
trained once for every test that reads them, what tests read of a run, made tokenizers and
checkpoints, the recipes' checks, serve.py's app on a loopback port. Starting commands: processes.py."""

import contextlib
import dataclasses
import fcntl
import functools
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from processes import REPO, STARTED, load_script, run, run_script, start_python

from gpt.data.chat_template import Template
from gpt.device.runtime import Runtime

# torch.compile's backend for tests about graphs rather than kernels: dynamo's graphs, AOTAutograd's
# forward and backward (the partitioner's split) and inductor's decompositions, run by ATen's kernels.
# Inductor on a CPU builds each fused kernel with g++, about 1 s apiece with a cold cache (as in CI).
ATEN_BACKEND = "aot_eager_decomp_partition"
GPT2 = {"kind": "tiktoken", "name": "gpt2", "vocab_size": 50257}  # tokenizer.describe of GPT-2's BPE
# the tiny shapes tests build a model.GPT of: GPT-2's block, and Llama's (RoPE, RMSNorm, SwiGLU, GQA, untied)
TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=65, dropout=0.0)
TINY_LLAMA = dict(
    TINY, n_kv_head=1, pos_encoding="rope", norm="rmsnorm", mlp="swiglu", bias=False, tie_embeddings=False
)
CPU = Runtime("cpu", "cpu", torch.float32)  # float32 on this process's CPU, whatever the machine has
FULL_DISK = Path("/dev") / "full"  # Linux's device whose every write fails with ENOSPC (a full disk)


def needs(*packages):
    """For a test (or, called at a test file's top, the whole file) that uses these packages: where one
    is missing, the test fails saying how to install it if the requirement files name it for this
    machine (make test installs them all), and skips if it is optional."""
    from packaging.requirements import Requirement

    for package in packages:
        try:
            importlib.metadata.distribution(package)  # installed, by its name on PyPI
            continue
        except importlib.metadata.PackageNotFoundError:
            pass
        for path in sorted(REPO.glob("requirements*.txt")):
            lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
            for wanted in map(Requirement, filter(None, lines)):
                if wanted.name == package and (wanted.marker is None or wanted.marker.evaluate()):
                    install = f"pip install -r {path.name} (make test installs every requirement file)"
                    pytest.fail(f"{package} is not installed, and the tests need it: {install}", pytrace=False)
        pytest.skip(f"{package} is not installed (optional here)", allow_module_level=True)


@pytest.fixture
def aten_compile(monkeypatch):
    """torch.compile (training_setup.build's, Muon's) with ATEN_BACKEND, dynamo's caches and counters
    fresh before and after; yields the counters."""
    import torch
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=ATEN_BACKEND))
    yield counters
    torch._dynamo.reset()


def make_text(n_chars=20000, seed=0):
    """Text with learnable structure: words from a small vocabulary, lines, punctuation."""
    rng = np.random.default_rng(seed)
    words = ["the", "king", "queen", "shall", "not", "be", "my", "lord", "what", "is", "love", "death", "now"]
    out, size = [], 0
    while size < n_chars:
        line = " ".join(rng.choice(words, size=rng.integers(3, 9))).capitalize() + rng.choice([".", "!", "?", ","])
        out.append(line)
        size += len(line) + 1
    return "\n".join(out)[:n_chars]


@pytest.fixture
def char_data(tmp_path):
    """A prepared character-level dataset directory (train.bin, val.bin, meta.json)."""
    return char_dataset(tmp_path / "chars")


def char_dataset(data_dir):
    """data_dir, made if it is not there, holding make_text() prepared as a character-level dataset."""
    data_dir.mkdir(parents=True, exist_ok=True)
    load_script("data/shakespeare_char/prepare.py").prepare(make_text(), str(data_dir))
    return data_dir


EVAL_WORDS = "the man picks up a ball and throws it to his dog who runs across the green field café naïve".split()


def write_hellaswag(path, n, seed=0):
    """n records in HellaSwag's official format (the fields eval.py ignores included), every 7th long."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            ctx = " ".join(rng.choice(EVAL_WORDS, size=60 if i % 7 == 0 else rng.integers(4, 12)))
            endings = [" ".join(rng.choice(EVAL_WORDS, size=rng.integers(1, 7))) + "." for _ in range(4)]
            record = dict(ind=i, activity_label="Playing fetch", ctx_a=ctx, ctx_b="", ctx=ctx, split="val")
            record.update(split_type="indomain", label=int(rng.integers(4)), endings=endings, source_id=f"test~{i}")
            f.write(json.dumps(record) + "\n")
    return path


def bpe_eval_data(root):
    """(root/data, root/hs.jsonl): a GPT-2 BPE dataset (train, val, test) and a HellaSwag-format file
    of 30 records, for eval.py's tasks."""
    from gpt.data import token_files, tokenizer

    enc = tokenizer.encoding("gpt2")
    rng = np.random.default_rng(1)
    data_dir = root / "data"
    data_dir.mkdir()
    for split, n_docs in (("train", 400), ("val", 40), ("test", 40)):
        docs = [" ".join(rng.choice(EVAL_WORDS, size=rng.integers(5, 30))).capitalize() + "." for _ in range(n_docs)]
        ids = [t for d in docs for t in [enc.eot_token] + enc.encode_ordinary(d)]
        token_files.write(str(data_dir / f"{split}.bin"), np.array(ids, dtype=np.uint16))
    (data_dir / "meta.json").write_text(json.dumps(GPT2))
    return data_dir, write_hellaswag(root / "hs.jsonl", 30, seed=2)


def tiny_args(data_dir, out_dir, **overrides):
    """train.py flags for a model that trains in seconds, on the CPU whatever the machine has."""
    args = dict(device="cpu", compile=False, dataset=data_dir, out_dir=out_dir, n_layer=2, n_head=2, n_embd=32)
    args.update(block_size=16, batch_size=4, gradient_accumulation_steps=1, dropout=0.0, learning_rate=1e-2)
    args.update(min_lr=1e-3, max_iters=20, lr_decay_iters=20, warmup_iters=2, eval_interval=10, eval_iters=2)
    args.update(log_interval=1)
    args.update(overrides)
    return [f"--{k}={v}" for k, v in args.items()]


# bench.py's keys for a model it measures in a second, on the CPU whatever the machine has
TINY_BENCH = dict(device="cpu", compile=False, n_layer=1, n_head=2, n_embd=32, block_size=16, batch_size=2)
TINY_BENCH.update(gradient_accumulation_steps=1, bench_iters=2, bench_warmup=1)


def tiny_bench_args(**overrides):
    """bench.py flags for TINY_BENCH's model, with `overrides`."""
    return [f"--{k}={v}" for k, v in {**TINY_BENCH, **overrides}.items()]


def train_tiny_run(root, **overrides):
    """root/out: a tiny character model trained on root/chars for a few steps (block_size 16)."""
    result = run_script("train.py", *tiny_args(char_dataset(root / "chars"), root / "out", **overrides))
    assert result.returncode == 0, result.stderr
    return root / "out"


def read_metrics(out_dir):
    """The records of out_dir/metrics.jsonl, in order."""
    with open(Path(out_dir) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def untimed(out_dir):
    """out_dir's metrics.jsonl without its timings (dt_ms, tokens_per_s, mfu): two runs that computed
    the same give equal lists. Each record as JSON text, so that a NaN loss equals itself."""
    timings = ("dt_ms", "tokens_per_s", "mfu")
    return [json.dumps({k: v for k, v in r.items() if k not in timings}) for r in read_metrics(out_dir)]


def losses(out_dir):
    """Every loss out_dir's metrics.jsonl logged, in order: training steps, then the evals' train and val losses."""
    return [r[k] for r in read_metrics(out_dir) for k in ("loss", "train_loss", "val_loss") if k in r]


def save_checkpoint(out_dir, model, tokenizer_spec):
    """out_dir (made here) holding model's ckpt.pt as train.py writes one, at iter 0 with no config."""
    out_dir.mkdir()
    state = {"model": model.state_dict(), "model_args": dataclasses.asdict(model.config), "config": {}}
    state.update(iter_num=0, best_val_loss=math.nan, tokenizer=tokenizer_spec)
    torch.save(state, out_dir / "ckpt.pt")
    return out_dir


def one_line_error(result, *fragments):
    """The one line a command printed for bad input, checked: a non-zero exit, no traceback, that
    line alone on stderr as `error: ...`, holding each fragment."""
    lines = result.stderr.strip().splitlines()
    assert result.returncode != 0 and "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    assert all(fragment in lines[0] for fragment in fragments), (lines[0], fragments)
    return lines[0]


def tree_files(root=REPO):
    """The files of the tree as a fresh clone has it (git ls-files); in a copy that is no checkout,
    through an empty repository beside it. Files, not links (the venv, linked into a copy)."""
    with tempfile.TemporaryDirectory() as empty:
        git = ["git"] if (root / ".git").exists() else ["git", f"--git-dir={empty}", f"--work-tree={root}"]
        if len(git) > 1:
            run(["git", "init", "-q", "--bare", empty], cwd=root)
        listed = run([*git, "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root)
    assert listed.returncode == 0, listed.stderr
    names = filter(None, listed.stdout.split("\0"))
    return sorted(n for n in names if (root / n).is_file() and not (root / n).is_symlink())


def pytest_sessionfinish():
    """Kill what start_python started and a failed test left running (a run of 100,000 steps), children too."""
    for proc in STARTED:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def steps_by_iter(out_dir):
    """{iter: record} of out_dir's training steps (the records with a loss)."""
    return {r["iter"]: r for r in read_metrics(out_dir) if "loss" in r}


# ---------------------------------------------------------------------------- torchft replica groups

# one global batch of 4 micro-batches (a group of 1 rank takes 2 of them, a rank of a 2-rank group 1);
# a checkpoint every 12 steps, the one at step 12 kept for the resume. dist_timeout_s only bounds a
# failure: two groups started at once on the 2-core machine may wait long for each other's first quorum
FT_COMMON = dict(
    max_iters=24,
    lr_decay_iters=24,
    eval_interval=12,
    gradient_accumulation_steps=4,
    always_save_checkpoint=True,
    keep_last=2,
    dist_timeout_s=120,
)


def ft_group(char_data, out, g, lighthouse, log, **extra):
    """train.py as replica group g of 2 at `lighthouse`, its output in the file `log` (torchft logs
    every quorum: a pipe nobody reads would fill and stop it)."""
    keys = {**FT_COMMON, "ft_replica_group": g, "ft_groups": 2, "ft_lighthouse": lighthouse, **extra}
    return start_python([REPO / "train.py", *tiny_args(char_data, out, **keys)], log, env={"OMP_NUM_THREADS": "1"})


def ft_parameter_bytes(out):
    """The bytes of the parameters of the model in out/group0/ckpt.pt: what one sync sends."""
    from gpt.outdir import checkpoint
    from model import GPT, GPTConfig

    model_args = checkpoint.load(str(out / "group0" / "ckpt.pt"))["model_args"]
    return sum(p.nbytes for p in GPT(GPTConfig(**model_args)).parameters())


def _build_chat_demo(root):
    """config/chat_demo_cpu.py's whole path, shortened, under root: 15,000 synthetic conversations
    (48 held out), the 512-token tokenizer, prepare.py, 180 steps of train.py at Muon's rate 0.03."""
    data, out = root / "data", root / "out"
    load_script("data/chat/synthetic.py").main([f"--out_dir={data}", "--n=15000", "--n_heldout=48", "--seed=0"])
    load_script("data/train_tokenizer.py").main(
        ["--input", f"{data}/text.txt", "--vocab_size=512", f"--out_dir={data}"]
    )
    prepare = ["--input", f"{data}/train.jsonl", f"--tokenizer={data}/tokenizer.json", f"--out_dir={data}"]
    load_script("data/chat/prepare.py").main([*prepare, "--block_size=128"])
    steps = [f"--{key}=180" for key in ("max_iters", "lr_decay_iters", "eval_interval")]
    train = ["config/chat_demo_cpu.py", f"--dataset={data}", f"--out_dir={out}", "--eval_iters=2", "--muon_lr=0.03"]
    result = run_script("train.py", *train, *steps)
    assert result.returncode == 0, result.stderr


def built_once(tmp_path_factory, name, build):
    """The folder `name` for the whole test run, built by the first worker to ask (under a lock)."""
    root = tmp_path_factory.getbasetemp()
    root = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / name  # above the workers'
    with open(f"{root}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (root / "built").exists():
            shutil.rmtree(root, ignore_errors=True)  # a build cut short
            root.mkdir()
            build(root)
            (root / "built").touch()
    return root


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """The out_dir of one tiny character run (30 steps, one eval at the end), trained once per test
    run; its dataset is out_dir.parent / "chars". Read only: a test that writes takes tiny_run_copy."""
    build = lambda root: train_tiny_run(root, max_iters=30, lr_decay_iters=30, eval_interval=30)
    return built_once(tmp_path_factory, "tiny_run", build) / "out"


@pytest.fixture
def tiny_run_copy(tiny_run, tmp_path):
    """A copy of tiny_run's out_dir, tmp_path / "run", to write in."""
    return Path(shutil.copytree(tiny_run, tmp_path / "run"))


@pytest.fixture(scope="session")
def shared_chat_demo(tmp_path_factory):
    """(out_dir, held-out conversations) of the chat demo at 15% of its steps (Muon's rate 0.03: as
    many held-out answers right as 250 steps at 0.02), trained once per test run. Read only."""
    root = built_once(tmp_path_factory, "shared_chat_demo", _build_chat_demo)
    return root / "out", [json.loads(line) for line in (root / "data" / "heldout.jsonl").read_text().splitlines()]


def chat_demo_copy(shared, to):
    """(a copy of shared_chat_demo's out_dir at `to`, to export into or train on; its held-out conversations)."""
    shutil.copytree(shared[0], to)
    return to, shared[1]


# ---------------------------------------------------------------------------- made tokenizers and checkpoints

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And 東京 🙂 naïve?"},
        {"role": "assistant", "content": "Tokyo, e\u0301, 👩‍👩‍👧 ok"},
    ],
    # whitespace at the edges and inside, newlines, tabs, digits, code
    [
        {"role": "user", "content": "  leading spaces\n\nand a blank line\t"},
        {"role": "assistant", "content": "\n def f(x):\n    return x * 12345\n\n"},
        {"role": "user", "content": "'ll 've 're?"},
        {"role": "assistant", "content": " ...  !"},
    ],
]


def make_llama3_tokenizer(path):
    """A small Llama-3-like tokenizer.json: byte-level BPE with GPT-4's split pattern, Llama 3's
    special tokens added after the merges, and its post-processor that puts <|begin_of_text|>
    first (which apply_chat_template must not add a second time)."""
    from tokenizers import AddedToken, pre_tokenizers, processors, trainers

    tok = load_script("data/train_tokenizer.py").new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([make_text(20000, seed=3)], trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIALS])
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    tok.save(str(path))
    return path


def make_trained_tokenizer(out_dir):
    """A tokenizer.json made by data/train_tokenizer.py itself."""
    text = out_dir / "text.txt"
    text.write_text(make_text(30000, seed=5) + "\n東京 🙂 naïve café\n")
    load_script("data/train_tokenizer.py").main(
        ["--input", str(text), "--vocab_size=400", f"--out_dir={out_dir}", "--val_chars=2000"]
    )
    return out_dir / "tokenizer.json"


EOT_128K = "<|end_of_text|>"


def make_128k_tokenizer(path):
    """A word-level tokenizer.json with Llama 3's vocabulary size (128,256): word "w<i>" is id i,
    so the ids of a text are known without the tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 128255)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([EOT_128K])  # an added token, id 128255, as Llama 3's specials are
    tok.save(str(path))
    return path


def save_chat_checkpoint(out_dir, model, spec):
    """A checkpoint as train.py writes it for chat data (its tokenizer description records the template)."""
    template = Template(spec)
    return save_checkpoint(out_dir, model, {**spec, "vocab_size": template.vocab_size, "chat": template.meta()})


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__")


def count_host_reads(monkeypatch):
    """Counts the calls that read a tensor's values back to the host (on a GPU each one waits for
    all the work queued before it): patched onto torch.Tensor, each still does its real work."""
    calls = []
    for name in HOST_READS:
        real = getattr(torch.Tensor, name)

        def read(self, *args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    return calls


# ---- recipes (test_recipes.py)

CHAT_VOCAB, USER, ASSISTANT, END = 40, 1, 2, 3  # a made-up chat template's size, role and end-of-turn tokens


def conversations(n=60, seed=0):
    """Token lists and masks: [USER, question..., END, ASSISTANT, answer..., END] repeated 1-3
    turns; the answer is the question reversed, so there is something to learn. mask marks the
    answer and its END, the tokens the model is trained to produce."""
    rng = np.random.default_rng(seed)
    convs = []
    for _ in range(n):
        ids, mask = [], []
        for _ in range(rng.integers(1, 4)):
            q = list(rng.integers(4, CHAT_VOCAB, size=rng.integers(2, 9)))
            ids += [USER, *q, END, ASSISTANT, *q[::-1], END]
            mask += [0] * (len(q) + 3) + [1] * (len(q) + 1)
        convs.append((np.array(ids), np.array(mask, dtype=np.uint8)))
    return convs


def chat_arrays(convs):
    """(ids, mask, starts) of conversations, as data/chat/prepare.py writes a split."""
    ids = np.concatenate([c[0] for c in convs]).astype(np.uint16)
    mask = np.concatenate([c[1] for c in convs])
    starts = np.cumsum([0] + [len(c[0]) for c in convs[:-1]]).astype(np.int64)
    return ids, mask, starts


def write_chat_dir(path, convs_train=None, convs_val=None):
    """path, made: a chat dataset of conversations (200 to train on, 40 held out by default)."""
    from gpt.data import token_files

    path.mkdir()
    for split, convs in (("train", convs_train or conversations(200)), ("val", convs_val or conversations(40, 1))):
        ids, mask, starts = chat_arrays(convs)
        token_files.write(str(path / f"{split}.bin"), ids)
        np.save(path / f"{split}_mask.npy", mask)
        np.save(path / f"{split}_starts.npy", starts)
    chars = "".join(chr(0x100 + i) for i in range(CHAT_VOCAB))  # a character vocabulary of CHAT_VOCAB symbols
    (path / "meta.json").write_text(json.dumps({"chars": chars, "chat": {"format": "test"}}))
    return path


def assert_equal_states(a, b, path="state"):
    """Two checkpoint states (nested dicts and lists of tensors and numbers) equal, bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_equal_states(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_equal_states(x, y, f"{path}[{i}]")
    else:
        assert a == b, (path, a, b)


def assert_same_run(run, reference, checkpoint="ckpt.pt"):
    """run computed what reference did, bit for bit: every logged record (untimed: no step missing or
    repeated, no extra eval), and the checkpoint's iter, weights and optimizer state (each optimizer's,
    Muon's and AdamW's)."""
    assert untimed(run) == untimed(reference)
    a, b = (torch.load(Path(d) / checkpoint, weights_only=True) for d in (run, reference))
    assert a["iter_num"] == b["iter_num"]
    assert_equal_states(a["model"], b["model"], "model")
    states = lambda opt: [opt["state"]] if "state" in opt else [o["state"] for o in opt["optimizers"]]
    assert_equal_states(states(a["optimizer"]), states(b["optimizer"]), "optimizer")


# ---- chat models through chat.py and their Hugging Face export (test_chat.py, test_rl.py)


def chat(out_dir, *args, stdin=None):
    saved = sys.stdin
    sys.stdin = io.StringIO(stdin or "")
    try:
        result = run_script("chat.py", f"--out_dir={out_dir}", "--device=cpu", *args)
    finally:
        sys.stdin = saved
    assert result.returncode == 0, result.stderr
    return result


CONVERSATIONS = [
    [{"role": "user", "content": "Reverse: sule pova kire"}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "My name is Dovaki."}],
    [{"role": "user", "content": "Hi, I'm Zuvaki. 東京 🙂"}],
]


def check_export(out_dir, max_new_tokens, *, expect_end=False, init_from_export=False, conversations=CONVERSATIONS):
    """hf.py's export of out_dir: apply_chat_template's ids and greedy generate()'s replies are chat.py's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = run_script("hf.py", f"--out_dir={out_dir}")
    assert result.returncode == 0, result.stderr
    export_dir = out_dir / "hf"
    hf_tok = AutoTokenizer.from_pretrained(str(export_dir))
    hf_model = AutoModelForCausalLM.from_pretrained(str(export_dir))
    spec = torch.load(out_dir / "ckpt.pt", weights_only=True)["tokenizer"]
    template = Template(spec)
    assert hf_model.generation_config.eos_token_id == template.end_id == hf_tok.eos_token_id
    ended = 0
    for messages in conversations:
        ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert ids == template.render(messages, add_generation_prompt=True)[0]
        greedy = dict(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=template.end_id)
        out = hf_model.generate(torch.tensor([ids]), **greedy, pad_token_id=template.end_id)[0, len(ids) :].tolist()
        ended += out[-1] == template.end_id
        reply = hf_tok.decode(out[:-1] if out[-1] == template.end_id else out)
        system = [f"--system={m['content']}" for m in messages if m["role"] == "system"]
        source = [f"--init_from={export_dir}"] if init_from_export else []
        prompt = [f"--prompt={messages[-1]['content']}", "--temperature=0", f"--max_new_tokens={max_new_tokens}"]
        ours = chat(out_dir, *source, *system, *prompt)
        assert ours.stdout == reply + "\n", (messages, init_from_export, ours.stderr)
    assert ended == len(conversations) or not expect_end
    return export_dir


# ---- serving (test_serve.py, test_engine.py, test_serve_browser.py)


@pytest.fixture(scope="module")
def serve_demo(tmp_path_factory, shared_chat_demo):
    """(out_dir, held-out conversations) of the shortened chat demo run (shared_chat_demo, copied
    for a module's servers)."""
    return chat_demo_copy(shared_chat_demo, tmp_path_factory.mktemp("serve_demo") / "out")


@contextlib.contextmanager
def running(*args):
    """serve.py's app under uvicorn in a thread, on a free loopback port (the command's own socket):
    a namespace of its url, its serving.Server, that server's engine (None: --engine=process) and uvicorn's
    Server."""
    import uvicorn

    import serve
    from configurator import parse
    from gpt.inference import api, serving

    server = serving.Server(parse(serve.ServeConfig, ["--device=cpu", "--engine=thread", *args])).start()
    sock = serve.listen("127.0.0.1", 0)
    web = uvicorn.Server(uvicorn.Config(api.make_app(server), log_level="warning"))
    thread = threading.Thread(target=web.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not web.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield types.SimpleNamespace(
            url=f"http://127.0.0.1:{sock.getsockname()[1]}", server=server, engine=server.engine, web=web
        )
    finally:
        web.should_exit = True
        thread.join(10)
        server.close()
        sock.close()


@contextlib.contextmanager
def watching(engine, on_step):
    """The engine's on_step hook is on_step until the block ends."""
    engine.on_step = on_step
    try:
        yield
    finally:
        engine.on_step = None


def concurrently(fns):
    """Call each function on a thread of its own, all at once: their results, in order."""
    results = [None] * len(fns)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, fns[i]())) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results
