"""Examples per second of the CORE scorer (gpt/evaluation/core.py) on synthetic tasks made here (every task
type, few-shot 0 to 3, a multi-character delimiter) and a small random GPT-2-vocabulary model,
three ways:
  batched          core.py: the choices of many examples in one forward, logits only where scored
  one per forward  core.py with batch_tokens=0: the same scorer, one example per forward
  nanochat's way   one example per forward, the logits, cross-entropy and argmax of every
                   position, then the mean over the continuation (nanochat/core_eval.py's
                   forward_model and evaluate_example), on the same tokens
They run in turn, --rounds times; the medians are printed, and the verdicts compared.

    python dev/core_bench.py                       # 5 rounds, 432 examples, batch_tokens 16 x block_size
    python dev/core_bench.py --rounds=7 --n_layer=4 --n_embd=128 --block_size=256
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpt.data import tokenizer
from gpt.device import runtime
from gpt.evaluation import core
from model import GPT, GPTConfig

GPT2 = {"kind": "tiktoken", "name": "gpt2", "vocab_size": 50257}
WORDS = "the man picks up a ball and throws it to his dog who runs across green field".split()
# label: (type, shots, delimiter, records at scale 1, random baseline as a fraction): 108 records
TASKS = {
    "mc_zero": ("multiple_choice", 0, " ", 24, 0.25),
    "mc_fewshot": ("multiple_choice", 2, "\nAnswer: ", 24, 0.25),
    "schema_fewshot": ("schema", 1, " ", 20, 0.5),
    "lm_zero": ("language_modeling", 0, " ", 20, 0.0),
    "lm_fewshot": ("language_modeling", 3, ": ", 20, 0.0),
}


def synthetic_tasks(scale, seed=0):
    """[core.Task]: TASKS with `scale` times their records, sentences of WORDS drawn at random."""
    rng = np.random.default_rng(seed)
    sentence = lambda lo, hi: " ".join(rng.choice(WORDS, size=rng.integers(lo, hi)))
    make = {
        "multiple_choice": lambda: {
            "query": sentence(3, 9).capitalize() + "?",
            "choices": [w + " " + sentence(1, 3) for w in rng.choice(WORDS, 4, replace=False)],
            "gold": int(rng.integers(4)),
        },
        "schema": lambda: {
            "context_options": [sentence(2, 7) + " " + w for w in rng.choice(WORDS, 2, replace=False)],
            "continuation": sentence(2, 5),
            "gold": int(rng.integers(2)),
        },
        "language_modeling": lambda: {"context": sentence(3, 9), "continuation": sentence(1, 4)},
    }
    return [
        core.Task(label, kind, shots, delimiter, baseline, [(f"{label}:{i}", make[kind]()) for i in range(n * scale)])
        for label, (kind, shots, delimiter, n, baseline) in TASKS.items()
    ]


@torch.no_grad()
def nanochat_way(model, tasks, spec, block_size):
    """{label: [0/1 per example]} by nanochat's per-example procedure (its steps, on our tokens)."""
    encode_batch, bos = tokenizer.batch_encoder(spec), tokenizer.eot(spec)
    verdicts = {}
    for task in tasks:
        verdicts[task.label] = []
        for i in range(len(task.records)):
            rows, answer = core.encode(task, i, encode_batch, bos, block_size)
            x = torch.full(
                (len(rows), max(len(ids) for ids, _ in rows)), bos, dtype=torch.long
            )  # right-padded with BOS
            for r, (ids, _) in enumerate(rows):
                x[r, : len(ids)] = torch.tensor(ids)
            logits, _ = model(x, logits_at="all")  # (B, T, vocab): every position
            losses = F.cross_entropy(logits.flatten(0, 1), torch.roll(x, -1, 1).flatten(), reduction="none").view(
                x.shape
            )
            predictions = logits.argmax(-1)
            spans = [(len(ids) - n, len(ids)) for ids, n in rows]
            if task.kind == "language_modeling":
                ((s, e),) = spans
                verdicts[task.label].append(int(bool((predictions[0, s - 1 : e - 1] == x[0, s:e]).all())))
            else:
                means = [losses[r, s - 1 : e - 1].mean().item() for r, (s, e) in enumerate(spans)]
                verdicts[task.label].append(int(means.index(min(means)) == answer))
    return verdicts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_embd", type=int, default=64)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--scale", type=int, default=4, help="records: this many times 108")
    parser.add_argument(
        "--batch", type=int, default=16, help="batch_tokens = batch x block_size (eval.py's --batch_size)"
    )
    args = parser.parse_args()

    rt = runtime.setup("cpu", "float32")
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(n_layer=args.n_layer, n_head=2, n_embd=args.n_embd, block_size=args.block_size, vocab_size=50257)
    ).eval()
    tasks = synthetic_tasks(args.scale)
    n = sum(len(t.records) for t in tasks)
    print(
        f"{n} examples in {len(tasks)} tasks; GPT n_layer={args.n_layer} n_embd={args.n_embd} block_size={args.block_size} "
        f"vocab 50257; torch threads {torch.get_num_threads()}"
    )
    ways = {"batched": args.batch * args.block_size, "one per forward": 0, "nanochat's way": None}
    speeds, verdicts = {name: [] for name in ways}, {}
    for r in range(args.rounds):
        for name, batch_tokens in ways.items():
            t0 = time.perf_counter()
            if batch_tokens is None:
                verdicts[name] = nanochat_way(model, tasks, GPT2, args.block_size)
            else:
                result = core.evaluate_core(model, tasks, GPT2, args.block_size, rt, batch_tokens, per_example=True)
                verdicts[name] = {k: v["correct"] for k, v in result["tasks"].items()}
            speeds[name].append(n / (time.perf_counter() - t0))
            accuracy = {k: round(sum(v) / len(v), 4) for k, v in verdicts[name].items()}
            print(f"round {r}: {name}: {speeds[name][-1]:.1f} examples/s, accuracies {accuracy}")
    batched = statistics.median(speeds["batched"])
    for name in ("one per forward", "nanochat's way"):
        other = statistics.median(speeds[name])
        print(
            f"median: batched {batched:.1f} examples/s, {name} {other:.1f} examples/s: {batched / other:.2f}x; "
            f"same verdicts: {verdicts['batched'] == verdicts[name]}"
        )


if __name__ == "__main__":
    main()
