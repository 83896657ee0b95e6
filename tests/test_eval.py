"""eval.py: choice losses against transformers' GPT-2, accuracies on a hand-built case, bits per byte
against a hand count, train.py's evals in rhythm across a resume, bad input, no host read per batch."""

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import CPU, GPT2, TINY, bpe_eval_data, count_host_reads, read_metrics, tiny_args, write_hellaswag
from processes import REPO, run_python, run_script

from gpt.data import token_files, tokenizer
from gpt.evaluation import scoring, tasks
from model import GPT, GPTConfig


def tiny_hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=2)).eval()


def test_choice_losses_equal_transformers_gpt2(tmp_path):
    from gpt.weights import huggingface

    hf_model = tiny_hf_gpt2()
    model = huggingface.gpt_from_hf(hf_model)[0].eval()
    examples = tasks.load_hellaswag(str(write_hellaswag(tmp_path / "hs.jsonl", 12)))
    encoded = tasks.encode_examples(examples, GPT2)
    assert any(len(c) + max(map(len, ch)) > 65 for c, ch, *_ in encoded)  # some contexts are cut to their end
    rows = [tasks._cropped(context, choice, 65) for context, choices, *_ in encoded for choice in choices]
    totals, _ = scoring.row_losses(model, rows, CPU)
    i = 0
    for context, choices, *_ in encoded:
        for choice in choices:
            ids = torch.tensor([(context + choice)[-65:]])  # the last block_size + 1 tokens
            with torch.no_grad():
                logits = hf_model(ids[:, :-1]).logits[0]  # (T, vocab)
            losses = F.cross_entropy(logits, ids[0, 1:], reduction="none")[-len(choice) :]  # the choice's tokens only
            assert rows[i][1] == len(choice)
            assert abs(totals[i].item() - losses.sum().item()) <= 1e-5 * max(1.0, losses.sum().item())
            i += 1


class Unigram(torch.nn.Module):
    """A model whose next-token distribution is the same fixed one everywhere: the loss of a
    choice is the sum of -log p over its tokens, countable by hand."""

    def __init__(self, probs):
        super().__init__()
        self.log_probs = torch.log(torch.tensor(probs))

    def forward(self, idx, logits_at=None):
        return self.log_probs.expand(*(idx.shape if logits_at is None else logits_at.shape), -1), None


def test_acc_and_both_acc_norms_on_a_hand_built_case():
    # token 1: p=0.1 (2.30 nats); token 2: p=0.4 (0.92 nats). Choice [1] totals 2.30, mean 2.30;
    # choice [2, 2, 2] totals 2.75, mean 0.92: the lowest total and the lowest mean disagree
    model = Unigram([0.5, 0.1, 0.4])
    # acc_norm_chars divides by the choices' characters: short has 10 (0.23 per character), long 5
    # (0.55), [1, 1] 5 (0.92)
    short, long = [1], [2, 2, 2]
    encoded = [
        ([0], [short, long], 0, [10, 5]),  # answer the short one: right by total and by characters
        ([0, 0], [long, short], 0, [5, 10]),  # answer the long one: right by mean only
        ([0], [short, long, [1, 1]], 0, [10, 5, 5]),
    ]  # short beats [1, 1] (4.61, mean 2.30) and long by total
    result = tasks.score_choices(model, encoded, block_size=8, rt=CPU, batch_size=2)
    assert result == {"acc": 2 / 3, "acc_norm_tokens": 1 / 3, "acc_norm_chars": 2 / 3, "n": 3}


def char_model_and_data(tmp_path):
    text = "Il était une fois, à Noël, un élève naïf.\n" * 30
    chars = "".join(sorted(set(text)))
    spec = {"kind": "char", "chars": chars}
    ids = np.array([chars.index(c) for c in text], dtype=np.uint16)
    torch.manual_seed(0)
    return (
        GPT(GPTConfig(**dict(TINY, vocab_size=len(chars)))).eval(),
        spec,
        ids,
        lambda targets: len("".join(chars[i] for i in targets).encode("utf-8")),
    )


def bpe_model_and_data(tmp_path):
    enc = tokenizer.encoding("gpt2")
    docs = ["Un café crème, s'il vous plaît. 東京 is Tokyo 🚀.", "Naïve façades: the ångström and the € sign."] * 10
    ids = np.array([t for d in docs for t in [enc.eot_token] + enc.encode_ordinary(d)], dtype=np.uint16)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(TINY, vocab_size=50257))).eval()
    # the text of the targets, decoded as one byte string (BPE tokens can split a character); <|endoftext|> is no text
    return model, GPT2, ids, lambda targets: len(enc.decode_bytes([t for t in targets if t != enc.eot_token]))


@pytest.mark.parametrize("make", [char_model_and_data, bpe_model_and_data], ids=["char", "bpe"])
def test_bits_per_byte_equals_a_hand_count(make, tmp_path):
    model, spec, ids, text_bytes = make(tmp_path)
    path = str(tmp_path / "val.bin")
    token_files.write(path, ids)
    data = token_files.Tokens.open(str(tmp_path), "val")
    result = tasks.split_loss(model, data, 16, CPU, tokenizer.token_bytes(spec), batch_size=3)
    n = (len(ids) - 1) // 16
    x = torch.from_numpy(ids[: n * 16].astype(np.int64)).view(n, 16)
    y = torch.from_numpy(ids[1 : n * 16 + 1].astype(np.int64)).view(n, 16)
    with torch.no_grad():
        nats = F.cross_entropy(
            model(x, logits_at="all")[0].reshape(-1, model.config.vocab_size), y.reshape(-1), reduction="sum"
        ).item()
    expected = nats / (math.log(2) * text_bytes(ids[1 : n * 16 + 1].tolist()))
    assert result["tokens"] == n * 16
    assert abs(result["loss"] - nats / (n * 16)) < 1e-5
    assert abs(result["bpb"] - expected) < 1e-5 * expected


@pytest.fixture(scope="module")
def bpe_setup(tmp_path_factory):
    """A tiny Hugging Face GPT-2 directory, a BPE dataset (val, test) and a HellaSwag-format file."""
    root = tmp_path_factory.mktemp("bpe")
    tiny_hf_gpt2().save_pretrained(root / "gpt2-tiny")
    return root, *bpe_eval_data(root)


def test_training_logs_bpb_test_loss_and_hellaswag_in_rhythm_across_resume(bpe_setup, tmp_path):
    root, data_dir, hs = bpe_setup
    out = tmp_path / "out"
    common = dict(hellaswag_interval=4, hellaswag_path=hs, hellaswag_examples=10, eval_interval=5, eval_iters=2)
    common.update(block_size=32, lr_decay_iters=12)
    first = run_script("train.py", *tiny_args(data_dir, out, max_iters=6, **common))
    assert first.returncode == 0, first.stderr
    resumed = run_script("train.py", *tiny_args(data_dir, out, max_iters=10, init_from="resume", **common))
    assert resumed.returncode == 0, resumed.stderr
    records = read_metrics(out)
    hellaswag = [r for r in records if "hellaswag_acc" in r]
    assert [r["iter"] for r in hellaswag] == [0, 4, 6, 8, 10]  # every 4 steps and at each run's end, none twice
    assert all(0 <= r["hellaswag_acc"] <= 1 and 0 <= r["hellaswag_acc_norm"] <= 1 for r in hellaswag)
    evals_ = [r for r in records if "val_loss" in r]
    assert [r["iter"] for r in evals_] == [0, 5, 6, 10]
    assert [r["iter"] for r in evals_ if "test_loss" in r] == [6, 10]  # once at the end of each run
    # val bpb by hand: the fixed eval windows' targets decoded to text (train.py's own offsets)
    from gpt.data.batches import eval_offsets

    enc = tokenizer.encoding("gpt2")
    val = token_files.Tokens.open(str(data_dir), "val")
    offsets = eval_offsets(val, 2, 4, 32, 1337 + 2)
    n_bytes = sum(
        len(enc.decode_bytes([t for t in val[o + 1 : o + 33].tolist() if t != enc.eot_token]))
        for o in offsets.reshape(-1)
    )
    for r in evals_:
        assert r["val_bpb"] == pytest.approx(r["val_loss"] * 2 * 4 * 32 / (math.log(2) * n_bytes), rel=1e-9)

    plotted = run_script("plot.py", out)  # a fourth panel, HellaSwag, joins loss, learning rate and tokens/s
    assert plotted.returncode == 0, plotted.stderr
    width = int.from_bytes((out / "metrics.png").read_bytes()[16:20], "big")
    assert width > 2000


def test_eval_of_a_char_run_defaults_to_its_splits(tiny_run):
    result = run_script("eval.py", f"--out_dir={tiny_run}", "--device=cpu", "--json=True")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert list(out) == ["val"] and out["val"]["tokens"] > 0 and out["val"]["bpb"] > 0  # no hellaswag, no test split


def test_bad_input_is_one_line_and_a_nonzero_exit(tiny_run, bpe_setup, tmp_path):
    root, data_dir, hs = bpe_setup
    (tmp_path / "bad.jsonl").write_text('{"ctx": "a", "endings": ["b", "c"], "label": 0}\nnot json\n')
    (tmp_path / "short.jsonl").write_text('{"context": "a", "choices": ["b", "c"]}\n')
    gpt2 = f"--init_from={root / 'gpt2-tiny'}"
    cases = [
        ([gpt2, "--tasks=hellaswag", f"--hellaswag_path={tmp_path / 'missing.jsonl'}"], "does not exist"),
        ([gpt2, "--tasks=hellaswag", f"--hellaswag_path={tmp_path / 'bad.jsonl'}"], "bad.jsonl:2 is not a JSON object"),
        ([gpt2, "--tasks=mc", f"--mc_path={tmp_path / 'short.jsonl'}"], "short.jsonl:1 lacks 'answer'"),
        ([f"--out_dir={tiny_run}", "--tasks=hellaswag", f"--hellaswag_path={hs}"], "character-level"),
        ([gpt2, "--tasks=hellaswag,mmlu"], "unknown task 'mmlu'"),
    ]
    for args, message in cases:
        result = run_script("eval.py", "--device=cpu", *args)
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (args, result.stderr)


def test_eval_loops_read_the_device_once_whatever_the_number_of_batches(monkeypatch, tmp_path):
    # The loops of split_loss and score_choices keep their sums on the device; the host reads
    # them once at the end. With 1 batch or 8, the same reads: none of them is per batch.
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=50257)).eval()
    token_files.write(str(tmp_path / "val.bin"), np.random.default_rng(0).integers(0, 50257, 3000).astype(np.uint16))
    data = token_files.Tokens.open(str(tmp_path), "val")
    token_bytes = tokenizer.token_bytes(GPT2)
    encoded = tasks.encode_examples(tasks.load_hellaswag(str(write_hellaswag(tmp_path / "hs.jsonl", 16))), GPT2)
    calls = count_host_reads(monkeypatch)
    reads = {}
    for batches in (1, 8):
        del calls[:]
        tasks.split_loss(model, data, 16, CPU, token_bytes, batch_size=8 // batches, max_tokens=8 * 16)
        reads["split_loss", batches] = sorted(calls)
        del calls[:]
        tasks.score_choices(model, encoded, 16, CPU, batch_size=16 // batches)
        reads["score_choices", batches] = sorted(calls)
    assert reads["split_loss", 1] == reads["split_loss", 8], reads
    assert reads["score_choices", 1] == reads["score_choices", 8], reads
    assert len(reads["split_loss", 8]) <= 2 and len(reads["score_choices", 8]) <= 2, reads  # the final .cpu().tolist()


@pytest.mark.process
@pytest.mark.skipif(
    not os.environ.get("LM_EVAL_PYTHON"), reason="set LM_EVAL_PYTHON to a Python with lm-eval installed (its own venv)"
)
def test_harness_style_equals_lm_evaluation_harness():
    # scripts/harness_hellaswag.py: lm-eval's own hellaswag task and
    # --hellaswag_style=harness on one GPT-2-shaped export and one local file; every
    # log-likelihood, verdict and accuracy compared
    harness = REPO / "scripts" / "harness_hellaswag.py"
    result = run_python([harness, f"--lm_eval_python={os.environ['LM_EVAL_PYTHON']}", "--examples=24"], timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("equal"), (
        result.stdout[-3000:] + result.stderr[-3000:]
    )
