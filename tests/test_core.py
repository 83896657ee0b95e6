"""gpt/evaluation/core.py, CORE as nanochat scores it, on a bundle built here with every task type: each
verdict against a direct computation (nanochat's Jinja templates, its few-shot draw, the model's own
logits), batched against one example per forward, 2 gloo ranks against 1, bad input, train.py's loop."""

import csv
import json
import os
import random
import shutil
import zipfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import GPT2, bpe_eval_data, count_host_reads, one_line_error, read_metrics, save_checkpoint, tiny_args
from processes import REPO, run_python, run_script

from configurator import UserError
from gpt.data import tokenizer
from gpt.device import runtime
from gpt.evaluation import core

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
    """Logits that depend on the position's token only: language_modeling records can be built to be right."""

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
            query, gold = sentence(rng, 3, 9).capitalize() + "?", int(rng.integers(4))
            firsts = rng.choice(WORDS, 4, replace=False)
            choices = [w + " " + sentence(rng, 0, 3) if rng.random() < 0.7 else w for w in firsts]
            out.append({"query": query, "gold": gold, "choices": choices})
        elif kind == "schema":  # options that end with different words: the shared suffix is the continuation
            options = [sentence(rng, 2, 7) + " " + w for w in rng.choice(WORDS, 2, replace=False)]
            out.append({"context_options": options, "continuation": sentence(rng, 2, 5), "gold": int(rng.integers(2))})
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
    rng, files, entries = np.random.default_rng(seed), {}, []
    for label, (kind, shots, delimiter, n, _) in TASKS.items():
        entry = dict(label=label, dataset_uri=f"synthetic/{label}.jsonl", num_fewshot=[shots], icl_task_type=kind)
        if delimiter is not None:
            entry["continuation_delimiter"] = delimiter
        entries.append(entry)
        records = records_for(kind, n, rng, model, " " if delimiter is None else delimiter)
        files[f"eval_data/synthetic/{label}.jsonl"] = "".join(json.dumps(r) + "\n" for r in records)
    files["core.yaml"] = yaml.safe_dump({"icl_tasks": entries})
    rows = "".join(f"{label},synthetic,{b}\n" for label, (*_, b) in TASKS.items())
    files["eval_meta_data.csv"] = "Eval Task,Task Category,Random baseline\n" + rows
    (root / "meta.csv").write_text(files["eval_meta_data.csv"])
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
    """Each example's verdict computed directly: few-shot drawn by hand, prompts rendered by jinja2, a forward a row."""
    from jinja2 import Template

    kind, shots, delimiter, _, _ = TASKS[label]
    delimiter = " " if delimiter is None else delimiter
    data = [json.loads(line) for line in (bundle / f"eval_data/synthetic/{label}.jsonl").read_text().splitlines()]
    random.Random(1337).shuffle(data)
    data = data[:max_per_task] if max_per_task > 0 else data
    template = Template(TEMPLATES[kind].strip())
    enc = tokenizer.encoding("gpt2")
    verdicts = []
    for i, item in enumerate(data):
        others = [j for j in range(len(data)) if j != i]
        fewshot = [data[j] for j in random.Random(1234 + i).sample(others, shots)]
        ctx = dict(fewshot_examples=fewshot, continuation_delimiter=delimiter, item=item)
        if kind == "multiple_choice":
            texts = [template.render(choice=c, **ctx) for c in item["choices"]]
        elif kind == "schema":
            texts = [template.render(context=c, **ctx) for c in item["context_options"]]
        else:
            without, with_ = (template.render(include_continuation=c, **ctx) for c in (False, True))
            texts = [without.strip(), with_]
        toks = [[enc.eot_token] + enc.encode_ordinary(t) for t in texts]
        shortest = min(map(len, toks))
        if kind == "multiple_choice":  # each choice's tokens start where the rows first differ
            start = next(k for k in range(shortest + 1) if k == shortest or len({t[k] for t in toks}) > 1)
            spans = [(start, len(t)) for t in toks]
        elif kind == "schema":  # the continuation is the suffix the rows share
            suffix = next(k for k in range(shortest + 1) if k == shortest or len({t[-1 - k] for t in toks}) > 1)
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


def test_each_verdict_at_any_batch_size_equals_a_direct_computation_and_core_is_the_mean_centered_accuracy(setup):
    root, model, bundle, rt = setup
    tasks = core.load_tasks(str(bundle))
    assert [t.label for t in tasks] == list(TASKS)
    reference = {label: reference_verdicts(bundle, label, model) for label in TASKS}
    for batch_tokens in (0, 4 * BLOCK, 64 * BLOCK, 8 * BLOCK):  # 0: one example per forward
        result = core.evaluate_core(model, tasks, GPT2, BLOCK, rt, batch_tokens=batch_tokens, per_example=True)
        assert {k: r["correct"] for k, r in result["tasks"].items()} == reference, batch_tokens
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


def test_a_zip_in_nanochats_layout_equals_a_directory(setup, tmp_path):
    root, model, bundle, rt = setup
    tasks = core.load_tasks(str(bundle))
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
    data = [json.loads(line) for line in (bundle / "eval_data/synthetic/mc_fewshot.jsonl").read_text().splitlines()]
    random.Random(1337).shuffle(data)
    assert [r for _, r in first[1].records] == data[:7]
    result = core.evaluate_core(model, first, GPT2, BLOCK, rt, batch_tokens=8 * BLOCK, per_example=True)
    assert result["tasks"]["lm_fewshot"]["correct"] == reference_verdicts(bundle, "lm_fewshot", model, max_per_task=7)


MC = "eval_data/synthetic/mc_zero.jsonl"


def replace_line(at, text):
    """An edit of a bundle: line `at` (from 0) of mc_zero.jsonl replaced by text."""

    def edit(bundle):
        lines = (bundle / MC).read_text().splitlines()
        lines[at] = text
        (bundle / MC).write_text("\n".join(lines) + "\n")

    return edit


def broken(bundle, to, edit):
    """A copy of bundle at `to`, edited."""
    shutil.copytree(bundle, to)
    edit(to)
    return to


def renamed_type(bundle):
    (bundle / "core.yaml").write_text((bundle / "core.yaml").read_text().replace("schema", "cloze"))


BAD_BUNDLES = {  # id: (the edit, None for no bundle at all; what the one line says)
    "no-file": (lambda b: (b / MC).unlink(), "lacks eval_data/synthetic/mc_zero.jsonl"),
    "no-meta": (lambda b: (b / "eval_meta_data.csv").unlink(), "lacks eval_meta_data.csv"),
    "type": (renamed_type, "unknown icl_task_type 'cloze'"),
    "fields": (replace_line(2, json.dumps({"query": "q", "choices": ["a", "b"]})), "mc_zero.jsonl:3 lacks 'gold'"),
    "gold": (
        replace_line(4, json.dumps({"query": "q", "choices": ["a", "b"], "gold": 2})),
        "mc_zero.jsonl:5: gold 2 is not the index",
    ),
    "json": (replace_line(1, "{not json"), "mc_zero.jsonl:2 is not a JSON object"),
    "absent": (None, "does not exist"),
}


@pytest.mark.parametrize("case", BAD_BUNDLES)
def test_bad_bundles_are_one_line_naming_the_file_and_record(case, setup, tmp_path):
    edit, message = BAD_BUNDLES[case]
    path = tmp_path / "bundle" if edit is None else broken(setup[2], tmp_path / "bundle", edit)
    with pytest.raises(UserError) as e:
        core.load_tasks(str(path))
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_empty_continuation_is_found_when_the_example_is_encoded(setup, tmp_path):
    # choice 1's tokens are all shared with choice 0 (nanochat would average an empty slice, nan)
    root, model, bundle, rt = setup
    record = json.dumps({"query": "q", "choices": ["the man", "the"], "gold": 0})
    empty = broken(bundle, tmp_path / "empty", replace_line(0, record))
    with pytest.raises(UserError, match=r"mc_zero.jsonl:1: the continuation of option 1 tokenizes to nothing"):
        core.evaluate_core(model, core.load_tasks(str(empty)), GPT2, BLOCK, rt, 8 * BLOCK)


def test_a_bad_bundle_is_one_line_from_eval_py_and_nothing_is_written(setup, tmp_path):
    bad = broken(setup[2], tmp_path / "bundle", BAD_BUNDLES["no-file"][0])
    before = sorted(os.listdir(tmp_path))
    result = run_script("eval.py", "--init_from=gpt2", "--tasks=core", f"--core_bundle={bad}", "--device=cpu")
    one_line_error(result, "lacks eval_data/synthetic/mc_zero.jsonl")
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
    """A GPT-2-shaped checkpoint of our own (a Hugging Face one costs each rank transformers' import)."""
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=BLOCK, vocab_size=50257, dropout=0.0))
    return save_checkpoint(tmp_path_factory.mktemp("gpt2") / "gpt2-tiny", model, GPT2)


@pytest.mark.process
def test_torchrun_two_gloo_ranks_equal_one(setup, gpt2_tiny, tmp_path):
    """eval.py under torchrun, every task in one launch: CORE, HellaSwag, and val and test bits per byte."""
    root, model, bundle, rt = setup
    data_dir, hellaswag = bpe_eval_data(tmp_path)
    args = [f"--init_from={gpt2_tiny}", "--tasks=core,hellaswag,val,test", f"--core_bundle={bundle}"]
    args += [f"--dataset={data_dir}", f"--hellaswag_path={hellaswag}", "--device=cpu", "--batch_size=4", "--json=True"]
    one = run_script("eval.py", *args)
    assert one.returncode == 0, one.stderr
    two = run_python(
        ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", REPO / "eval.py", *args],
        env={"OMP_NUM_THREADS": "1"},
    )
    assert two.returncode == 0, two.stderr
    a, b = (json.loads(run.stdout.strip().splitlines()[-1]) for run in (one, two))
    per_task = lambda r: {k: (t["accuracy"], t["examples"]) for k, t in r["core"]["tasks"].items()}
    assert per_task(a) == per_task(b)
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
def test_training_logs_core_in_rhythm_an_out_of_memory_costs_the_run_nothing_and_plot_shows_it(
    setup, tmp_path, monkeypatch
):
    """CORE every 2 steps and at the run's end (9), raising out-of-memory at steps 4 and 6 (patched
    here): the run trains on to its end, the step's checkpoint was already written when CORE started,
    and each failure is one line and a record in metrics.jsonl."""
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
    keys = dict(core_interval=2, core_max_per_task=5, core_bundle=bundle, always_save_checkpoint=True)
    args = tiny_args(data_dir, out, max_iters=9, lr_decay_iters=9, eval_interval=2, block_size=BLOCK, **keys)
    result = run_script("train.py", *args)
    assert result.returncode == 0, result.stderr
    assert found == [None, 2, 4, 6, 8, 9]  # CORE ran after its step's checkpoint
    records = read_metrics(out)
    assert [r["iter"] for r in records if "core" in r] == [0, 2, 8, 9]
    assert all(set(r) == {"iter", "core", *(f"core/{k}" for k in TASKS)} for r in records if "core" in r)
    failed = [r for r in records if "core_failed" in r]
    assert [r["iter"] for r in failed] == [4, 6]
    assert all(r["core_failed"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB" for r in failed)
    assert [r["iter"] for r in records if "loss" in r] == list(range(9))  # every step trained
    said = [line for line in result.stdout.splitlines() if "CORE failed" in line or "core failed" in line]
    assert said == [
        f"step {i}: core failed, training goes on (OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB)"
        for i in (4, 6)
    ]
    assert torch.load(out / "ckpt.pt", weights_only=True)["iter_num"] == 9
    plotted = run_script("plot.py", out)
    assert plotted.returncode == 0, plotted.stderr
    assert int.from_bytes((out / "metrics.png").read_bytes()[16:20], "big") > 2000  # a fourth panel, CORE


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
