"""gpt/evaluation/core.py, CORE as nanochat scores it: a bundle built here with every task type, few-shot
counts of 0 and more and a multi-character continuation delimiter. Each example's verdict against
a direct computation (nanochat's Jinja templates rendered by jinja2, its few-shot draw over an
explicit list, the model's own logits per row); CORE against the meta CSV; batched against one
example per forward; the same examples on every run; torchrun with 2 gloo ranks against 1 (with
eval.py's other tasks in the same launch); the bad-input catalogue; CORE in train.py's loop."""

import csv
import json
import os
import random
import zipfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import bpe_eval_data, count_host_reads, read_metrics, tiny_args
from processes import REPO, run_python, run_script

from configurator import UserError
from gpt.data import tokenizer
from gpt.device import runtime
from gpt.evaluation import core

GPT2 = {"kind": "tiktoken", "name": "gpt2", "vocab_size": 50257}
WORDS = "the man picks up a ball and throws it to his dog who runs across green field".split()
BLOCK = 48  # short enough that the few-shot prompts are cropped from the left
# label: (type, shots, delimiter or None for the default " ", records, random baseline in percent)
TASKS = {
    "mc_zero": ("multiple_choice", 0, None, 24, 25.0),
    "mc_fewshot": ("multiple_choice", 2, "\nAnswer: ", 24, 25.0),
    "schema_fewshot": ("schema", 1, None, 20, 50.0),
    "lm_zero": ("language_modeling", 0, None, 20, 0.0),
    "lm_fewshot": ("language_modeling", 3, ": ", 20, 0.0),
}


class Bigram(torch.nn.Module):
    """A model whose logits at a position depend on that position's token only: its greedy next
    token is known in advance, so language_modeling records can be built to be right."""

    def __init__(self, vocab=50257, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, 16, generator=g)  # (vocab, 16) @ (16, vocab): a low-rank bigram table
        self.proj = torch.randn(16, vocab, generator=g)
        self.bias = torch.zeros(vocab)
        self.bias[[tokenizer.encoding("gpt2").encode_ordinary(" " + w)[0] for w in WORDS]] = 30.0  # greedy picks a word

    def forward(self, idx, logits_at=None):
        # a position's logits depend on its token only
        idx = idx.flatten()[logits_at] if torch.is_tensor(logits_at) else idx
        return self.table[idx] @ self.proj + self.bias, None

    def greedy_next(self, token):
        return int(self(torch.tensor([[token]]))[0][0, 0].argmax())


def sentence(rng, lo, hi):
    return " ".join(rng.choice(WORDS, size=rng.integers(lo, hi)))


def records_for(kind, n, rng, model, delimiter):
    enc = tokenizer.encoding("gpt2")
    out = []
    for i in range(n):
        if kind == "multiple_choice":  # choices that start with different words: none is a prefix of another
            out.append(
                {
                    "query": sentence(rng, 3, 9).capitalize() + "?",
                    "gold": int(rng.integers(4)),
                    "choices": [
                        w + " " + sentence(rng, 0, 3) if rng.random() < 0.7 else w
                        for w in rng.choice(WORDS, 4, replace=False)
                    ],
                }
            )
        elif kind == "schema":  # options that end with different words: the shared suffix is the continuation
            out.append(
                {
                    "context_options": [sentence(rng, 2, 7) + " " + w for w in rng.choice(WORDS, 2, replace=False)],
                    "continuation": sentence(rng, 2, 5),
                    "gold": int(rng.integers(2)),
                }
            )
        else:
            context = sentence(rng, 3, 9) + ("  " if i % 3 == 0 else "")  # trailing spaces: stripped, as nanochat does
            # a continuation greedy decoding gives: follow the model's own chain from the context's last token
            if i % 2 == 0:
                token, words = enc.encode_ordinary(context.strip() + delimiter.rstrip())[-1], []
                for _ in range(3):
                    token = model.greedy_next(token)
                    words.append(enc.decode([token]).strip())
                continuation = " ".join(words)
            else:
                continuation = sentence(rng, 1, 4)
            out.append({"context": context, "continuation": continuation})
    return out


def write_bundle(root, model, zipped=False, seed=0):
    """root/bundle (or root/eval_bundle.zip holding eval_bundle/...): core.yaml, eval_data, the meta CSV."""
    rng = np.random.default_rng(seed)
    files = {}
    entries = []
    for label, (kind, shots, delimiter, n, _) in TASKS.items():
        entry = {
            "label": label,
            "dataset_uri": f"synthetic/{label}.jsonl",
            "num_fewshot": [shots],
            "icl_task_type": kind,
        }
        if delimiter is not None:
            entry["continuation_delimiter"] = delimiter
        entries.append(entry)
        records = records_for(kind, n, rng, model, " " if delimiter is None else delimiter)
        files[f"eval_data/synthetic/{label}.jsonl"] = "".join(json.dumps(r) + "\n" for r in records)
    import yaml

    files["core.yaml"] = yaml.safe_dump({"icl_tasks": entries})
    rows = [
        {"Eval Task": label, "Task Category": "synthetic", "Random baseline": b} for label, (*_, b) in TASKS.items()
    ]
    with open(root / "meta.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    files["eval_meta_data.csv"] = (root / "meta.csv").read_text()
    if zipped:
        with zipfile.ZipFile(root / "eval_bundle.zip", "w") as z:
            for name, text in files.items():
                z.writestr(f"eval_bundle/{name}", text)
        return root / "eval_bundle.zip"
    for name, text in files.items():
        (root / "bundle" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "bundle" / name).write_text(text)
    return root / "bundle"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("core")
    model = Bigram().eval()
    return root, model, write_bundle(root, model), runtime.setup("cpu", "float32")


# ---------------------------------------------------------------------------- the reference


TEMPLATES = {  # nanochat's templates (nanochat/core_eval.py), rendered by jinja2 as there
    "multiple_choice": """
{%- for example in fewshot_examples -%}
{{ example.query }}{{ continuation_delimiter }}{{ example.choices[example.gold] }}

{% endfor -%}
{{ item.query }}{{ continuation_delimiter }}{{ choice }}""",
    "schema": """
{%- for example in fewshot_examples -%}
{{ example.context_options[example.gold] }}{{ continuation_delimiter }}{{ example.continuation }}

{% endfor -%}
{{ context }}{{ continuation_delimiter }}{{ item.continuation }}""",
    "language_modeling": """
{%- for example in fewshot_examples -%}
{{ example.context | trim }}{{ continuation_delimiter }}{{ example.continuation }}

{% endfor -%}
{{ item.context | trim }}{{ continuation_delimiter }}{% if include_continuation %}{{ item.continuation }}{% endif %}""",
}


def reference_verdicts(bundle, label, model, max_per_task=0):
    """Each example's verdict computed directly: the data read and shuffled, the few-shot drawn
    from an explicit list, the prompts rendered by jinja2, one forward per row."""
    from jinja2 import Template

    kind, shots, delimiter, _, _ = TASKS[label]
    delimiter = " " if delimiter is None else delimiter
    with open(os.path.join(bundle, "eval_data", "synthetic", f"{label}.jsonl")) as f:
        data = [json.loads(line) for line in f]
    random.Random(1337).shuffle(data)
    data = data[:max_per_task] if max_per_task > 0 else data
    template = Template(TEMPLATES[kind].strip())
    enc = tokenizer.encoding("gpt2")
    verdicts = []
    for i, item in enumerate(data):
        fewshot = (
            [data[j] for j in random.Random(1234 + i).sample([j for j in range(len(data)) if j != i], shots)]
            if shots
            else []
        )
        ctx = dict(fewshot_examples=fewshot, continuation_delimiter=delimiter, item=item)
        if kind == "multiple_choice":
            texts = [template.render(choice=c, **ctx) for c in item["choices"]]
        elif kind == "schema":
            texts = [template.render(context=c, **ctx) for c in item["context_options"]]
        else:
            texts = [
                template.render(include_continuation=False, **ctx).strip(),
                template.render(include_continuation=True, **ctx),
            ]
        toks = [[enc.eot_token] + enc.encode_ordinary(t) for t in texts]
        if kind == "multiple_choice":
            start = next(
                k for k in range(min(map(len, toks)) + 1) if k == min(map(len, toks)) or len({t[k] for t in toks}) > 1
            )
            spans = [(start, len(t)) for t in toks]
        elif kind == "schema":
            suffix = next(
                k
                for k in range(min(map(len, toks)) + 1)
                if k == min(map(len, toks)) or len({t[-1 - k] for t in toks}) > 1
            )
            spans = [(len(t) - suffix, len(t)) for t in toks]
        else:
            toks, spans = [toks[1]], [(len(toks[0]), len(toks[1]))]
        scores = []
        for t, (s, e) in zip(toks, spans):
            crop = max(0, len(t) - BLOCK)
            t, s, e = t[crop:], s - crop, e - crop
            logits = model(torch.tensor([t]), logits_at="all")[0][0]  # (T, vocab)
            if kind == "language_modeling":
                scores.append(bool((logits[s - 1 : e - 1].argmax(-1) == torch.tensor(t[s:e])).all()))
            else:
                scores.append(F.cross_entropy(logits[s - 1 : e - 1], torch.tensor(t[s:e])).item())
        verdicts.append(int(scores[0]) if kind == "language_modeling" else int(int(np.argmin(scores)) == item["gold"]))
    return verdicts


# ---------------------------------------------------------------------------- the tests


def test_each_verdict_equals_a_direct_computation_and_core_is_the_mean_centered_accuracy(setup):
    root, model, bundle, rt = setup
    tasks = core.load_tasks(str(bundle))
    assert [t.label for t in tasks] == list(TASKS)
    result = core.evaluate_core(model, tasks, GPT2, BLOCK, rt, batch_tokens=8 * BLOCK, per_example=True)
    for label, r in result["tasks"].items():
        assert r["correct"] == reference_verdicts(bundle, label, model), label
    # the language_modeling tasks hold right and wrong records: greedy decoding is checked both ways
    assert 0 < result["tasks"]["lm_zero"]["accuracy"] < 1 and 0 < result["tasks"]["lm_fewshot"]["accuracy"] < 1
    with open(root / "meta.csv") as f:
        baselines = {row["Eval Task"]: float(row["Random baseline"]) / 100 for row in csv.DictReader(f)}
    centered = []
    for label, r in result["tasks"].items():
        accuracy = sum(r["correct"]) / len(r["correct"])
        assert r["accuracy"] == pytest.approx(accuracy)
        centered.append((accuracy - baselines[label]) / (1 - baselines[label]))
        assert r["centered"] == pytest.approx(centered[-1])
    assert result["core"] == pytest.approx(sum(centered) / len(centered))


def test_batched_equals_one_example_per_forward_and_a_zip_equals_a_directory(setup, tmp_path):
    root, model, bundle, rt = setup
    tasks = core.load_tasks(str(bundle))
    one = core.evaluate_core(model, tasks, GPT2, BLOCK, rt, batch_tokens=0, per_example=True)
    for batch_tokens in (4 * BLOCK, 64 * BLOCK):
        batched = core.evaluate_core(model, tasks, GPT2, BLOCK, rt, batch_tokens=batch_tokens, per_example=True)
        assert {k: r["correct"] for k, r in batched["tasks"].items()} == {
            k: r["correct"] for k, r in one["tasks"].items()
        }
    # the same bundle, zipped by nanochat's layout
    zipped = core.load_tasks(str(write_bundle(tmp_path, model, zipped=True)))
    assert [[r for _, r in t.records] for t in zipped] == [[r for _, r in t.records] for t in tasks]
    assert zipped[0].records[0][0].startswith(f"{tmp_path / 'eval_bundle.zip'}/eval_bundle/eval_data/")


def test_max_per_task_keeps_the_same_examples_on_every_run(setup):
    root, model, bundle, rt = setup
    first = core.load_tasks(str(bundle), max_per_task=7)
    again = core.load_tasks(str(bundle), max_per_task=7)
    assert all(len(t.records) == 7 for t in first)
    assert [[r for _, r in t.records] for t in first] == [[r for _, r in t.records] for t in again]
    # nanochat's subset: random.Random(1337) shuffles the whole file, then the first ones are kept
    with open(bundle / "eval_data" / "synthetic" / "mc_fewshot.jsonl") as f:
        data = [json.loads(line) for line in f]
    random.Random(1337).shuffle(data)
    assert [r for _, r in first[1].records] == data[:7]
    result = core.evaluate_core(model, first, GPT2, BLOCK, rt, batch_tokens=8 * BLOCK, per_example=True)
    assert result["tasks"]["lm_fewshot"]["correct"] == reference_verdicts(bundle, "lm_fewshot", model, max_per_task=7)


def test_bad_bundles_are_one_line_naming_the_file_and_record(setup, tmp_path):
    root, model, bundle, rt = setup
    import shutil

    def broken(name, edit):
        where = tmp_path / name
        shutil.copytree(bundle, where)
        edit(where)
        return where

    def rewrite(path, change):
        lines = path.read_text().splitlines()
        path.write_text("\n".join(change(lines)) + "\n")

    mc = "eval_data/synthetic/mc_zero.jsonl"
    record = lambda **fields: json.dumps(fields)
    cases = [
        (broken("nofile", lambda b: (b / mc).unlink()), "lacks eval_data/synthetic/mc_zero.jsonl"),
        (broken("nometa", lambda b: (b / "eval_meta_data.csv").unlink()), "lacks eval_meta_data.csv"),
        (
            broken(
                "type", lambda b: (b / "core.yaml").write_text((b / "core.yaml").read_text().replace("schema", "cloze"))
            ),
            "unknown icl_task_type 'cloze'",
        ),
        (
            broken(
                "fields",
                lambda b: rewrite(b / mc, lambda ls: ls[:2] + [record(query="q", choices=["a", "b"])] + ls[3:]),
            ),
            "mc_zero.jsonl:3 lacks 'gold'",
        ),
        (
            broken(
                "gold",
                lambda b: rewrite(b / mc, lambda ls: ls[:4] + [record(query="q", choices=["a", "b"], gold=2)] + ls[5:]),
            ),
            "mc_zero.jsonl:5: gold 2 is not the index",
        ),
        (
            broken("json", lambda b: rewrite(b / mc, lambda ls: ls[:1] + ["{not json"] + ls[2:])),
            "mc_zero.jsonl:2 is not a JSON object",
        ),
        (tmp_path / "absent", "does not exist"),
    ]
    for path, message in cases:
        with pytest.raises(UserError) as e:
            core.load_tasks(str(path))
        assert message in str(e.value) and "\n" not in str(e.value), (path, str(e.value))
    # a continuation that tokenizes to nothing is found when the example is encoded: here choice 1's
    # tokens are all shared with choice 0 (nanochat would average an empty slice, nan)
    empty = broken(
        "empty", lambda b: rewrite(b / mc, lambda ls: [record(query="q", choices=["the man", "the"], gold=0)] + ls[1:])
    )
    with pytest.raises(UserError, match=r"mc_zero.jsonl:1: the continuation of option 1 tokenizes to nothing"):
        core.evaluate_core(model, core.load_tasks(str(empty)), GPT2, BLOCK, rt, 8 * BLOCK)
    # from the command: one line, no traceback, nothing written
    before = sorted(os.listdir(tmp_path))
    result = run_script("eval.py", "--init_from=gpt2", "--tasks=core", f"--core_bundle={cases[0][0]}", "--device=cpu")
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().count("\n") == 0 and "lacks eval_data/synthetic/mc_zero.jsonl" in result.stderr
    assert sorted(os.listdir(tmp_path)) == before


def test_an_unreachable_download_is_one_line(monkeypatch, tmp_path):
    import urllib.request

    def offline(*args, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        UserError, match=r"cannot download https://karpathy-public.*eval_bundle.zip .*--core_bundle=PATH"
    ):
        core.load_tasks()
    assert not os.path.exists(core.BUNDLE_PATH)


# ---------------------------------------------------------------------------- the commands


@pytest.fixture(scope="module")
def gpt2_tiny(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("gpt2")
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=BLOCK, n_embd=32, n_layer=2, n_head=2)).save_pretrained(
        root / "gpt2-tiny"
    )
    return root / "gpt2-tiny"


@pytest.mark.process
def test_torchrun_two_gloo_ranks_equal_one(setup, gpt2_tiny, tmp_path):
    """eval.py under torchrun, every task in one launch: CORE, HellaSwag, and val and test bits per
    byte on 2 gloo ranks give what 1 rank gives."""
    root, model, bundle, rt = setup
    data_dir, hellaswag = bpe_eval_data(tmp_path)
    args = [
        f"--init_from={gpt2_tiny}",
        "--tasks=core,hellaswag,val,test",
        f"--core_bundle={bundle}",
        f"--dataset={data_dir}",
        f"--hellaswag_path={hellaswag}",
        "--device=cpu",
        "--batch_size=4",
        "--json=True",
    ]
    one = run_script("eval.py", *args)
    assert one.returncode == 0, one.stderr
    two = run_python(
        ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", REPO / "eval.py", *args],
        env={"OMP_NUM_THREADS": "1"},
    )
    assert two.returncode == 0, two.stderr
    a, b = (json.loads(run.stdout.strip().splitlines()[-1]) for run in (one, two))
    assert {k: (r["accuracy"], r["examples"]) for k, r in a["core"]["tasks"].items()} == {
        k: (r["accuracy"], r["examples"]) for k, r in b["core"]["tasks"].items()
    }
    assert a["core"]["core"] == b["core"]["core"] and a["core"]["examples"] == sum(n for *_, n, _ in TASKS.values())
    assert a["hellaswag"] == b["hellaswag"] and a["hellaswag"]["n"] == 30
    for split in ("val", "test"):
        assert a[split]["tokens"] == b[split]["tokens"] > 0
        for key in ("loss", "bpb"):
            assert a[split][key] == pytest.approx(b[split][key], rel=1e-6)
    lines = one.stdout.splitlines()
    assert any(line.startswith("mc_fewshot: accuracy ") and "centered" in line for line in lines)
    assert any(line.startswith("CORE ") and "examples/s" in line for line in lines)


@pytest.mark.slow
def test_training_logs_core_in_rhythm_and_plots_it(setup, tmp_path):
    root, model, bundle, rt = setup
    enc = tokenizer.encoding("gpt2")
    rng = np.random.default_rng(0)
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    from gpt.data import token_files

    for split, n_docs in (("train", 200), ("val", 30)):
        docs = [sentence(rng, 5, 20) for _ in range(n_docs)]
        token_files.write(
            str(data_dir / f"{split}.bin"),
            np.array([t for d in docs for t in [enc.eot_token] + enc.encode_ordinary(d)], dtype=np.uint16),
        )
    (data_dir / "meta.json").write_text(json.dumps(GPT2))
    out = tmp_path / "out"
    result = run_script(
        "train.py",
        *tiny_args(
            data_dir,
            out,
            max_iters=6,
            lr_decay_iters=6,
            eval_interval=3,
            block_size=BLOCK,
            core_interval=4,
            core_max_per_task=5,
            core_bundle=bundle,
        ),
    )
    assert result.returncode == 0, result.stderr
    records = [r for r in read_metrics(out) if "core" in r]
    assert [r["iter"] for r in records] == [0, 4, 6]
    assert all(set(r) == {"iter", "core", *(f"core/{k}" for k in TASKS)} for r in records)
    plotted = run_script("plot.py", out)
    assert plotted.returncode == 0, plotted.stderr
    width = int.from_bytes((out / "metrics.png").read_bytes()[16:20], "big")
    assert width > 2000  # a fourth panel, CORE


@pytest.mark.slow
def test_an_in_loop_eval_that_runs_out_of_memory_costs_the_run_nothing(setup, tmp_path, monkeypatch):
    """CORE raising out-of-memory at steps 4 and 6 (patched here): the run trains on to its end, the
    step's checkpoint was already written when CORE started, and each failure is one line and a
    record in metrics.jsonl."""
    root, model, bundle, rt = setup
    data_dir, _ = bpe_eval_data(tmp_path)
    out = tmp_path / "out"
    scored, found = core.evaluate_core, []

    def failing(*args, **kwargs):
        iters = [r["iter"] for r in read_metrics(out) if "train_loss" in r]
        found.append(torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] if iters[-1] > 0 else None)
        if iters[-1] in (4, 6):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return scored(*args, **kwargs)

    monkeypatch.setattr(core, "evaluate_core", failing)
    result = run_script(
        "train.py",
        *tiny_args(
            data_dir,
            out,
            max_iters=8,
            lr_decay_iters=8,
            eval_interval=2,
            block_size=BLOCK,
            always_save_checkpoint=True,
            core_interval=2,
            core_max_per_task=5,
            core_bundle=bundle,
        ),
    )
    assert result.returncode == 0, result.stderr
    assert found == [None, 2, 4, 6, 8]  # CORE ran after its step's checkpoint
    records = read_metrics(out)
    assert [r["iter"] for r in records if "core" in r] == [0, 2, 8]
    failed = [r for r in records if "core_failed" in r]
    assert [r["iter"] for r in failed] == [4, 6]
    assert all(r["core_failed"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" for r in failed)
    assert [r["iter"] for r in records if "loss" in r] == list(range(8))  # every step trained
    said = [line for line in result.stdout.splitlines() if "CORE failed" in line or "core failed" in line]
    assert said == [
        f"step {i}: core failed, training goes on (OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB)"
        for i in (4, 6)
    ]
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 8


def test_a_device_without_float64_sums_in_float32_with_the_same_results(setup, monkeypatch):
    # MPS has no float64: scoring.sum_dtype's branch, run on the CPU with the runtime saying 'mps'
    root, model, bundle, rt = setup
    from gpt.evaluation import scoring, tasks

    mps = runtime.Runtime("cpu", "mps", torch.float32)
    assert scoring.sum_dtype(mps) == torch.float32 and scoring.sum_dtype(rt) == torch.float64
    reads = []
    real = scoring.all_reduce
    monkeypatch.setattr(scoring, "all_reduce", lambda sums, r: reads.append(sums.dtype) or real(sums, r))
    core_tasks = core.load_tasks(str(bundle), max_per_task=8)
    a = core.evaluate_core(model, core_tasks, GPT2, BLOCK, mps, 8 * BLOCK, per_example=True)
    b = core.evaluate_core(model, core_tasks, GPT2, BLOCK, rt, 8 * BLOCK, per_example=True)
    assert {k: r["correct"] for k, r in a["tasks"].items()} == {k: r["correct"] for k, r in b["tasks"].items()}
    examples = [tasks.Example("the man picks up", ["a ball.", "his dog who runs.", "the green field."], 1)] * 5
    encoded = tasks.encode_examples(examples, GPT2)
    assert tasks.score_choices(model, encoded, BLOCK, mps, 2) == tasks.score_choices(model, encoded, BLOCK, rt, 2)
    assert set(reads) == {torch.float32, torch.float64}


def test_core_reads_the_device_once_per_task_whatever_the_number_of_batches(setup, monkeypatch):
    root, model, bundle, rt = setup
    tasks = core.load_tasks(str(bundle))
    calls = count_host_reads(monkeypatch)
    reads = {}
    for batch_tokens in (0, 10_000 * BLOCK):  # one example per forward (108 forwards), or one forward per task
        del calls[:]
        core.evaluate_core(model, tasks, GPT2, BLOCK, rt, batch_tokens)
        reads[batch_tokens] = sorted(calls)
    assert reads[0] == reads[10_000 * BLOCK] and len(reads[0]) == 2 * len(tasks), reads  # .cpu() and .item() per task
