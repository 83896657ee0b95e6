"""CORE, the DCLM paper's mean centered accuracy over 22 in-context tasks, scored as nanochat
scores it (nanochat/core_eval.py and scripts/base_eval.py), so the numbers are the same numbers.

The bundle (DCLM's eval data as nanochat packs it) is a directory or a zip holding
  core.yaml             icl_tasks: label, dataset_uri, num_fewshot [k], icl_task_type, continuation_delimiter
  eval_data/<uri>       one jsonl per task
  eval_meta_data.csv    'Eval Task' and 'Random baseline' (percent) per task

Per task: the records are shuffled with random.Random(1337) before max_per_task keeps the first
ones. Example i draws its k few-shot examples with random.Random(1234 + i) from the others. Every
prompt starts with the BOS token (<|endoftext|> for GPT-2's BPE) and, when longer than the
model's context, keeps its last block_size tokens.
  multiple_choice    right when the right choice has the lowest mean loss over its tokens (those
                     after the choices' common token prefix)
  schema             right when the right context option has the lowest mean loss over the shared
                     continuation (the options' common token suffix)
  language_modeling  right when greedy decoding gives the continuation's tokens exactly
centered = (accuracy - b) / (1 - b), b the random baseline as a fraction; CORE is their mean.

Unlike nanochat, which runs one forward per example, the choices of many examples are padded
into one forward pass (longest first, up to a token budget); the decisions are the same.
"""

import csv
import io
import json
import os
import random
import time
import zipfile
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from configurator import UserError
from gpt.data import download, tokenizer
from gpt.device.runtime import to_device
from gpt.evaluation import scoring

BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"  # nanochat's copy
BUNDLE_PATH = os.path.join("data", "core", "eval_bundle.zip")  # gitignored: the download, kept after the first run
SHUFFLE_SEED = 1337  # the order max_per_task cuts
FEWSHOT_SEED = 1234  # + the example's index
FIELDS = {
    "multiple_choice": ("query", "choices", "gold"),
    "schema": ("context_options", "continuation", "gold"),
    "language_modeling": ("context", "continuation"),
}


class Task(NamedTuple):
    label: str
    kind: str  # a key of FIELDS
    num_fewshot: int
    delimiter: str  # between a prompt and its continuation
    baseline: float  # the random baseline, a fraction
    records: list  # [(where, record)], shuffled and cut to max_per_task


# ---------------------------------------------------------------------------- the bundle


class Bundle:
    """The files of a bundle, from a directory or a zip (read in place, nothing extracted). The
    root is where core.yaml is: the path itself or one folder down (nanochat's zip has eval_bundle/)."""

    def __init__(self, path):
        self.path = path
        if os.path.isdir(path):
            self.zip, names = (
                None,
                [
                    n
                    for n in ("core.yaml", os.path.join("eval_bundle", "core.yaml"))
                    if os.path.isfile(os.path.join(path, n))
                ],
            )
        elif zipfile.is_zipfile(path):
            self.zip = zipfile.ZipFile(path)
            names = sorted((n for n in self.zip.namelist() if os.path.basename(n) == "core.yaml"), key=len)
        else:
            raise UserError(
                f"core_bundle={path} is neither a directory nor a zip; give the CORE eval bundle "
                f"(core.yaml, eval_data/, eval_meta_data.csv)"
            )
        if not names:
            raise UserError(
                f"{path} lacks core.yaml; give the CORE eval bundle (core.yaml, eval_data/, eval_meta_data.csv)"
            )
        self.root = os.path.dirname(names[0])

    def read(self, name):
        """The text of root/name; a missing file is one line naming it."""
        where = os.path.join(self.path, self.root, name)
        try:
            if self.zip is None:
                with open(where, encoding="utf-8") as f:
                    return f.read()
            return self.zip.read(f"{self.root}/{name}" if self.root else name).decode("utf-8")
        except (OSError, KeyError):
            raise UserError(
                f"the CORE bundle {self.path} lacks {os.path.join(self.root, name)}; give a complete bundle"
            )
        except UnicodeDecodeError:
            raise UserError(f"{where} is not UTF-8 text")


def bundle_path(path=""):
    """--core_bundle when given, else nanochat's bundle, downloaded once to data/core/."""
    if path:
        if not os.path.exists(path):
            raise UserError(
                f"core_bundle={path} does not exist; give the CORE eval bundle (a directory or eval_bundle.zip)"
            )
        return path
    return download.fetch(BUNDLE_URL, None, BUNDLE_PATH, local="--core_bundle=PATH")


def load_tasks(path="", max_per_task=0):
    """[Task] from the bundle, every record checked; max_per_task > 0 keeps that many per task,
    the same ones in every run."""
    import yaml

    bundle = Bundle(bundle_path(path))
    try:
        entries = yaml.safe_load(bundle.read("core.yaml"))["icl_tasks"]
    except (yaml.YAMLError, TypeError, KeyError):
        raise UserError(
            f"{os.path.join(bundle.path, bundle.root, 'core.yaml')} has no icl_tasks list; give the CORE bundle's core.yaml"
        )
    baselines = {
        row.get("Eval Task"): row.get("Random baseline")
        for row in csv.DictReader(io.StringIO(bundle.read("eval_meta_data.csv")))
    }
    return [_task(bundle, entry, n, baselines, max_per_task) for n, entry in enumerate(entries, 1)]


def _task(bundle, entry, n, baselines, max_per_task):
    where = f"{os.path.join(bundle.path, bundle.root, 'core.yaml')} task {n}"
    try:
        label, uri, kind, shots = entry["label"], entry["dataset_uri"], entry["icl_task_type"], entry["num_fewshot"][0]
    except (KeyError, TypeError, IndexError):
        raise UserError(f"{where} needs label, dataset_uri, icl_task_type and num_fewshot (a list)")
    if kind not in FIELDS:
        raise UserError(f"{where} ({label}): unknown icl_task_type {kind!r}; CORE has {', '.join(FIELDS)}")
    try:
        baseline = float(baselines[label]) / 100
    except (KeyError, TypeError, ValueError):
        raise UserError(f"eval_meta_data.csv of {bundle.path} has no 'Random baseline' for {label!r}")
    name = f"eval_data/{uri}"
    records = [
        _record(f"{os.path.join(bundle.path, bundle.root, name)}:{i}", line, kind)
        for i, line in enumerate(bundle.read(name).splitlines(), 1)
        if line.strip()
    ]
    random.Random(SHUFFLE_SEED).shuffle(records)  # the permutation depends on the count only, as nanochat's
    records = records[:max_per_task] if max_per_task > 0 else records
    if not records:
        raise UserError(f"{os.path.join(bundle.path, bundle.root, name)} holds no records")
    if not isinstance(shots, int) or not 0 <= shots < len(records):
        raise UserError(
            f"{where} ({label}): num_fewshot {shots!r} needs more records than that, it keeps {len(records)} "
            f"(raise max_per_task)"
        )
    return Task(label, kind, shots, str(entry.get("continuation_delimiter", " ")), baseline, records)


def _record(where, line, kind):
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not a JSON object ({e.msg})")
    missing = [k for k in FIELDS[kind] if not isinstance(record, dict) or k not in record]
    if missing:
        raise UserError(
            f"{where} lacks {', '.join(map(repr, missing))}; a {kind} record needs {', '.join(FIELDS[kind])}"
        )
    options = record.get("choices", record.get("context_options"))
    if kind != "language_modeling":
        if not isinstance(options, list) or not options:
            raise UserError(f"{where}: {FIELDS[kind][0] if kind == 'schema' else 'choices'} must be a non-empty list")
        gold = record["gold"]
        if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(options):
            raise UserError(f"{where}: gold {gold!r} is not the index of one of its {len(options)} options")
    return where, record


# ---------------------------------------------------------------------------- prompts and tokens


class _AllBut(Sequence):
    """range(n) without i, as a sequence random.sample can draw from (nanochat builds this list;
    sampling from it gives the same examples without the O(n) list per example)."""

    def __init__(self, n, i):
        self.n, self.i = n, i

    def __len__(self):
        return self.n - 1

    def __getitem__(self, j):
        if not 0 <= j < self.n - 1:
            raise IndexError(j)
        return j if j < self.i else j + 1


def fewshot(task, i):
    """The records shown before example i: k drawn by random.Random(1234 + i) from the others."""
    if not task.num_fewshot:
        return []
    picked = random.Random(FEWSHOT_SEED + i).sample(_AllBut(len(task.records), i), task.num_fewshot)
    return [task.records[j][1] for j in picked]


def prompts(task, i):
    """The texts of example i: one per choice (multiple_choice) or context option (schema); for
    language_modeling the prompt without its continuation (stripped) and with it. Few-shot
    examples come first, each followed by a blank line."""
    item, d = task.records[i][1], task.delimiter
    shots = fewshot(task, i)
    if task.kind == "multiple_choice":
        head = "".join(f"{ex['query']}{d}{ex['choices'][ex['gold']]}\n\n" for ex in shots)
        return [f"{head}{item['query']}{d}{choice}" for choice in item["choices"]]
    if task.kind == "schema":
        head = "".join(f"{ex['context_options'][ex['gold']]}{d}{ex['continuation']}\n\n" for ex in shots)
        return [f"{head}{option}{d}{item['continuation']}" for option in item["context_options"]]
    head = "".join(f"{str(ex['context']).strip()}{d}{ex['continuation']}\n\n" for ex in shots)
    without = f"{head}{str(item['context']).strip()}{d}"
    return [without.strip(), f"{without}{item['continuation']}"]


def _common(seqs, reverse=False):
    """Length of the token prefix (suffix: reverse) all of seqs share."""
    seqs = [s[::-1] for s in seqs] if reverse else seqs
    n = 0
    while n < min(map(len, seqs)) and all(s[n] == seqs[0][n] for s in seqs):
        n += 1
    return n


def encode(task, i, encode_batch, bos, block_size):
    """Example i as token rows [(ids, n)] (n: the scored last tokens) and its answer."""
    where = task.records[i][0]
    toks = [[bos] + ids for ids in encode_batch(prompts(task, i))]
    if task.kind == "multiple_choice":
        start = _common(toks)
        rows, answer = [(t, len(t) - start) for t in toks], task.records[i][1]["gold"]
    elif task.kind == "schema":
        rows, answer = [(t, _common(toks, reverse=True)) for t in toks], task.records[i][1]["gold"]
    else:
        without, full = toks
        if full[: len(without)] != without:
            raise UserError(f"{where}: the prompt's tokens without the continuation are not a prefix of those with it")
        rows, answer = [(full, len(full) - len(without))], 0
    for j, (ids, n) in enumerate(rows):
        if n == 0:
            raise UserError(
                f"{where}: the continuation of option {j} tokenizes to nothing after the shared tokens; "
                f"fix or drop the record"
            )
    # too long for the model: its last block_size tokens, as nanochat crops
    return [(ids[-block_size:], min(n, len(ids[-block_size:]) - 1)) for ids, n in rows], answer


# ---------------------------------------------------------------------------- scoring


def _batches(items, batch_tokens):
    """Items [(index, rows, answer)] longest first, packed while rows x longest row <=
    batch_tokens (0: one example per forward, nanochat's way)."""
    order = sorted(items, key=lambda it: -max(len(ids) for ids, _ in it[1]))
    batches, batch, rows = [], [], 0
    for item in order:
        longest = max(len(ids) for ids, _ in (batch[0] if batch else item)[1])
        if batch and (not batch_tokens or (rows + len(item[1])) * longest > batch_tokens):
            batches.append(batch)
            batch, rows = [], 0
        batch.append(item)
        rows += len(item[1])
    return batches + ([batch] if batch else [])


def score_task(model, task, spec, block_size, rt, batch_tokens):
    """(n,) on the device: 1 where this rank's examples of the task are right, 0 elsewhere."""
    encode_batch, bos = tokenizer.batch_encoder(spec), tokenizer.eot(spec)
    mine = [
        (i, *encode(task, i, encode_batch, bos, block_size)) for i in range(rt.rank, len(task.records), rt.world_size)
    ]
    batches = _batches(mine, batch_tokens)
    n_batches = len(batches)
    if rt.ddp:  # the same number of forwards on every rank (under FSDP each one is a collective)
        count = torch.tensor([n_batches], device=rt.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        n_batches = int(count.item())
    correct = torch.zeros(len(task.records), dtype=scoring.sum_dtype(rt), device=rt.device)
    # what a rank with no batch left runs, uncounted
    spare = [(0, *encode(task, 0, encode_batch, bos, block_size))] if n_batches > len(batches) else None
    for b in range(n_batches):
        batch = batches[b] if b < len(batches) else spare
        rows = [row for _, item_rows, _ in batch for row in item_rows]
        totals, greedy = scoring.row_losses(model, rows, rt, greedy=task.kind == "language_modeling")
        if b >= len(batches):
            continue
        if greedy is None:  # the lowest mean loss per scored token
            counts = to_device(torch.tensor([float(n) for _, n in rows], dtype=totals.dtype), rt)
            greedy = scoring.pick(totals / counts, [(len(r), a) for _, r, a in batch], rt)
        correct[to_device(torch.tensor([i for i, _, _ in batch]), rt)] = greedy.to(correct.dtype)
    return correct


def evaluate_core(model, tasks, spec, block_size, rt, batch_tokens, report=None, per_example=False):
    """{"tasks": {label: {accuracy, centered, seconds, examples}}, "core": the mean centered
    accuracy, "examples", "examples_per_s"}; `report(line)` is called after each task.
    per_example=True adds each task's "correct": 0/1 per record, in the shuffled order."""
    if spec["kind"] == "char":
        raise UserError("CORE needs a tokenizer that encodes any text; this model is character-level")
    was_training = getattr(model, "training", False)
    model.eval()
    results, start = {}, time.perf_counter()
    for task in tasks:
        t0 = time.perf_counter()
        # one read per task
        correct = scoring.all_reduce(score_task(model, task, spec, block_size, rt, batch_tokens), rt)
        n = len(correct)
        accuracy = correct.sum().item() / n
        centered = (accuracy - task.baseline) / (1 - task.baseline)
        results[task.label] = {
            "accuracy": accuracy,
            "centered": centered,
            "seconds": time.perf_counter() - t0,
            "examples": n,
            **({"correct": correct.int().tolist()} if per_example else {}),
        }
        if report:
            report(
                f"{task.label}: accuracy {accuracy:.4f}, centered {centered:.4f} "
                f"({int(n)} examples, {task.num_fewshot}-shot {task.kind}, {results[task.label]['seconds']:.1f} s)"
            )
    model.train(was_training)
    seconds = time.perf_counter() - start
    examples = sum(r["examples"] for r in results.values())
    return {
        "tasks": results,
        "core": float(np.mean([r["centered"] for r in results.values()])),
        "examples": examples,
        "examples_per_s": examples / seconds,
    }


def core_scores(model, core_tasks, spec, block_size, rt, batch_tokens):
    """(evaluate_core's result, the line train.py's log prints of it)."""
    r = evaluate_core(model, core_tasks, spec, block_size, rt, batch_tokens)
    return r, f"CORE {r['core']:.4f} ({r['examples']} examples, {r['examples_per_s']:.0f}/s)"
