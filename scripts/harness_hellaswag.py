"""eval.py --hellaswag_style=harness against lm-evaluation-harness's own hellaswag task, on the
same model and examples, with no network: a GPT-2-shaped model exported by hf.py, and a local
file of HellaSwag-format records (the hub's Rowan/hellaswag fields, with WikiHow's [title] and
[step] artifacts, double spaces, empty ctx_b, long contexts cut at the model's window).

    python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install torch==2.13.0 lm-eval transformers
    python scripts/harness_hellaswag.py --lm_eval_python=/tmp/lmeval/bin/python --examples=48

lm-eval runs in its own interpreter (its dependencies stay out of this project's venv), on its
registered hellaswag task with the dataset pointed at the local file (dataset_path json). The
script prints, per example, both sides' log-likelihoods of each choice and their verdicts, then
acc and acc_norm from each; it exits 1 if any verdict or accuracy differs, or a log-likelihood
differs by more than 1e-4.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORDS = (
    "the man woman picks up a ball and throws it to his dog who runs across green field then "
    "camera shows kitchen knife slices bread carefully before putting pan on stove"
).split()


def make_records(n, seed=0):
    """HellaSwag records in the hub's format (label a string), with the artifacts lm-eval's
    preprocessing removes."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = lambda lo, hi: " ".join(rng.choice(WORDS, size=rng.integers(lo, hi)))
    records = []
    for i in range(n):
        ctx_a = words(5, 60 if i % 6 == 0 else 14).capitalize() + "."
        if i % 4 == 1:
            ctx_a = f"[header] How to {words(2, 5)} [title] {ctx_a} [step]  {words(3, 8)}."
        ctx_b = "" if i % 5 == 2 else words(1, 4)
        endings = [
            words(2, 9) + (" [substeps] " + words(1, 4) if i % 7 == 3 and j == 1 else "") + "." for j in range(4)
        ]
        records.append(
            {
                "ind": i,
                "activity_label": f"Activity {words(1, 3)}",
                "ctx_a": ctx_a,
                "ctx_b": ctx_b,
                "ctx": (ctx_a + " " + ctx_b).strip(),
                "endings": endings,
                "source_id": f"synthetic~{i}",
                "split": "val",
                "split_type": "indomain",
                "label": str(int(rng.integers(4))),
            }
        )
    return records


def make_model(export_dir, n_positions=64):
    """A random GPT-2-shaped model (released GPT-2's layout, tiny) exported as hf.py exports."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from gpt.weights import huggingface

    torch.manual_seed(0)
    hf_model = GPT2LMHeadModel(
        GPT2Config(vocab_size=50257, n_positions=n_positions, n_embd=64, n_layer=2, n_head=2, initializer_range=0.3)
    )  # large weights: logits far from uniform
    model = huggingface.gpt_from_hf(hf_model)[0]
    huggingface.export(model, {"kind": "tiktoken", "name": "gpt2", "vocab_size": 50257}, export_dir)


HARNESS = r"""
import json, os, sys
import lm_eval.tasks
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks._yaml_loader import load_yaml

model_dir, data, out = sys.argv[1:4]
lm = HFLM(pretrained=model_dir, batch_size=8, device="cpu", dtype="float32")
# lm-eval's own hellaswag task (its yaml: process_docs, doc_to_text, doc_to_choice, metrics), its
# dataset read from the local file instead of the hub
task = load_yaml(os.path.join(os.path.dirname(lm_eval.tasks.__file__), "hellaswag", "hellaswag.yaml"), resolve_func=True)
task.update({"dataset_path": "json", "dataset_name": None, "dataset_kwargs": {"data_files": {"train": data, "validation": data}}})  # train: its few-shot pool, unused at 0 shots
results = simple_evaluate(model=lm, tasks=[task], log_samples=True, num_fewshot=0, random_seed=0)
samples = sorted(results["samples"]["hellaswag"], key=lambda s: s["doc_id"])
json.dump({"acc": results["results"]["hellaswag"]["acc,none"], "acc_norm": results["results"]["hellaswag"]["acc_norm,none"],
           "examples": [{"lls": [r[0][0] for r in s["resps"]], "acc": s["acc"], "acc_norm": s["acc_norm"],
                         "query": s["doc"]["query"], "choices": s["doc"]["choices"],
                         "arguments": [a[1] for a in s["arguments"]] if isinstance(s["arguments"][0], (list, tuple)) else None}
                        for s in samples]}, open(out, "w"))
"""


def ours(model_dir, data):
    """Per example the log-likelihood of each choice and the verdicts, by eval.py's own code."""
    import numpy as np

    from gpt.device import runtime
    from gpt.evaluation import scoring, tasks
    from gpt.weights import load

    rt = runtime.setup("cpu", "float32")
    model, tok_spec = load.pretrained(model_dir)
    model.eval()
    examples = tasks.load_hellaswag(data, style="harness")
    encoded = tasks.encode_examples(examples, tok_spec, joint=True)
    per_example = []
    for e, (context, choices, answer, chars) in zip(examples, encoded):
        rows = [tasks._cropped(context, c, model.config.block_size + 1) for c in choices]
        lls = (-scoring.row_losses(model, rows, rt)[0]).tolist()
        per_example.append(
            {
                "lls": lls,
                "acc": float(np.argmax(lls) == answer),
                "acc_norm": float(np.argmax(np.array(lls) / np.array(chars)) == answer),
                "query": e.context,
                "choices": e.choices,
            }
        )
    scores = tasks.score_choices(model, encoded, model.config.block_size, rt, batch_size=8)
    return scores, per_example


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm_eval_python", required=True, help="a Python with lm-eval installed (its own venv)")
    parser.add_argument("--examples", type=int, default=48)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data, model_dir, out = (
            os.path.join(tmp, "hellaswag.jsonl"),
            os.path.join(tmp, "gpt2-tiny"),
            os.path.join(tmp, "harness.json"),
        )
        with open(data, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in make_records(args.examples))
        make_model(model_dir)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        run = subprocess.run(
            [args.lm_eval_python, "-c", HARNESS, model_dir, data, out], env=env, capture_output=True, text=True
        )
        if run.returncode != 0:
            sys.exit(f"lm-eval failed:\n{run.stderr[-3000:]}")
        with open(out) as f:
            theirs = json.load(f)
        scores, mine = ours(model_dir, data)
    bad, worst = 0, 0.0
    for i, (a, b) in enumerate(zip(mine, theirs["examples"])):
        same_text = a["query"] == b["query"] and a["choices"] == b["choices"]
        diff = max(abs(x - y) for x, y in zip(a["lls"], b["lls"]))
        worst = max(worst, diff)
        ok = same_text and diff <= 1e-4 and a["acc"] == b["acc"] and a["acc_norm"] == b["acc_norm"]
        bad += not ok
        print(
            f"{i:3d} {'ok ' if ok else 'BAD'} acc {a['acc']:.0f}/{b['acc']:.0f} acc_norm {a['acc_norm']:.0f}/{b['acc_norm']:.0f} "
            f"max |ll diff| {diff:.2e} lls ours {[round(x, 4) for x in a['lls']]}"
        )
    print(
        f"examples: {len(mine)} (lm-eval {len(theirs['examples'])}); differing: {bad}; largest log-likelihood difference {worst:.2e}"
    )
    print(
        f"eval.py --hellaswag_style=harness: acc {scores['acc']:.4f}, acc_norm_chars {scores['acc_norm_chars']:.4f}, "
        f"acc_norm_tokens {scores['acc_norm_tokens']:.4f}"
    )
    print(f"lm-evaluation-harness hellaswag:   acc {theirs['acc']:.4f}, acc_norm {theirs['acc_norm']:.4f}")
    same = (
        bad == 0
        and len(mine) == len(theirs["examples"])
        and abs(scores["acc"] - theirs["acc"]) < 1e-12
        and abs(scores["acc_norm_chars"] - theirs["acc_norm"]) < 1e-12
    )
    print("equal" if same else "DIFFERENT")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
