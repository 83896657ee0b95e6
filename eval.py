"""How good is the model: HellaSwag, CORE, your own multiple-choice questions, and the loss of
the val and test splits in nats per token and bits per byte.

    python eval.py --out_dir=out-gpt2-fineweb-edu            # the run's best checkpoint: hellaswag, val, test
    python eval.py --out_dir=out --checkpoint=latest --tasks=val,test --split_tokens=0   # every token of both splits
    python eval.py --out_dir=out-speedrun-gpt2 --tasks=val_masked   # the speedruns' val loss: all of val, document-masked
    python eval.py --init_from=gpt2                          # released GPT-2 124M: acc 0.2859, acc_norm_tokens 0.2955
    python eval.py --init_from=gpt2 --hellaswag_style=harness   # as lm-evaluation-harness: acc_norm_chars 0.3114 published
    python eval.py --init_from=gpt2 --tasks=core             # CORE (nanochat reports 0.114 for GPT-2 124M)
    python eval.py --out_dir=out --tasks=core --core_bundle=eval_bundle.zip --core_max_per_task=500
    python eval.py --init_from=/path/to/gpt2 --hellaswag_path=hellaswag_val.jsonl        # no network
    python eval.py --out_dir=out --tasks=mc --mc_path=questions.jsonl
    python eval.py --out_dir=out --json=True                 # the last line is one JSON object
    torchrun --standalone --nproc_per_node=8 eval.py --init_from=gpt2-xl --tasks=hellaswag,core
    python eval.py --out_dir=out --watch=True --tasks=val,hellaswag   # each checkpoint as it lands, until the run ends
    python eval.py --out_dir=out --checkpoint=ckpt_0002000.pt --tasks=val   # one checkpoint by name
    python eval.py --help                                    # every key

The scoring is gpt/evaluation/tasks.py's (how a choice is scored, the two acc_norms, bits per byte).
Under torchrun the examples (or windows) are shared out between the ranks and the sums all-reduced.
--watch=True is gpt/evaluation/watch.py's loop around the same tasks: one record per checkpoint in the run's
metrics.jsonl, named watch/<train.py's name> (watch/val_loss, watch/hellaswag_acc_norm, watch/core)."""

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Literal

import torch

from configurator import UserError, parse, require, require_choice, require_choices, require_init_from, run_main
from gpt.data import token_files, tokenizer
from gpt.device import runtime
from gpt.evaluation import core, scoring, tasks, watch
from gpt.outdir import metrics
from gpt.weights import load

EVAL_TASKS = ("hellaswag", "mc", "val", "test", "val_masked", "core")
HELLASWAG_STYLES = ("nanogpt", "harness")


@dataclass
class EvalConfig:
    # one line per key, its trailing comment the key's --help text
    # fmt: off
    init_from: str = "resume"  # 'resume' (a training run's checkpoint in out_dir), 'gpt2'/'gpt2-medium'/'gpt2-large'/'gpt2-xl', a Hugging Face GPT-2 or Llama directory, or another run's out_dir
    out_dir: str = "out"  # the training run to evaluate
    checkpoint: str = "best"  # 'best' (ckpt_best.pt when present), 'latest' (ckpt.pt), or one by name: ckpt_<iter>.pt or ckpt_<iter> in out_dir, or a path
    watch: bool = False  # follow out_dir's run: score each checkpoint once as it lands, then exit when the run is over (docs/watch.md)
    tasks: str = ""  # comma list of hellaswag, mc, val, test, val_masked (all of val, document-masked: the speedruns' val loss), core; '': hellaswag (unless character-level), mc (with mc_path), and the splits the data has
    dataset: str = ""  # data/<dataset> holds val and test; '': the run's own (its config.json)
    split_tokens: int = 10_000_000  # val/test: score this many tokens from the split's start, each once; 0: the whole split (val_masked: always)
    hellaswag_path: str = ""  # a HellaSwag jsonl (ctx, endings, label); '': data/hellaswag/hellaswag_val.jsonl, downloaded once
    hellaswag_examples: int = 0  # score only this fixed subset of HellaSwag (a seeded sample); 0: all 10,042
    hellaswag_style: str = "nanogpt"  # 'nanogpt': build-nanogpt/llm.c's prompt (ctx); 'harness': lm-evaluation-harness's (preprocessed activity_label: ctx_a Ctx_b)
    core_bundle: str = ""  # the CORE eval bundle (a directory or zip); '': data/core/eval_bundle.zip, downloaded once
    core_max_per_task: int = 0  # CORE: score this many examples per task (nanochat's shuffle, then the first ones); 0: all
    mc_path: str = ""  # your own multiple-choice task: jsonl with context, choices (a list of strings), answer (an index)
    batch_size: int = 16  # examples (multiple choice) or block_size windows (val, test) per forward pass
    json: bool = False  # print the results as one JSON object on the last line
    device: str = "auto"  # 'auto', 'cpu', 'cuda', 'cuda:1', 'mps'
    dtype: str = "auto"  # 'auto' (bf16 autocast on a GPU), 'float32', 'bfloat16', 'float16'
    compile: bool = False  # torch.compile the model (pays off for the whole of HellaSwag on a GPU)
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # under torchrun: 'nccl', 'gloo', or 'auto' (nccl on CUDA, else gloo)
    # fmt: on

    def __post_init__(self):
        require_choices(self)
        require_init_from(self.init_from, ("resume",))
        require(
            not self.watch or self.init_from == "resume",
            f"--watch follows a training run: give its --out_dir, not --init_from={self.init_from}",
        )
        for task in self.task_list():
            require(task in EVAL_TASKS, f"unknown task {task!r} in --tasks; choose from {', '.join(EVAL_TASKS)}")
        require(
            "mc" not in self.task_list() or self.mc_path, "--tasks has mc but no --mc_path=FILE names the questions"
        )
        require(not self.watch or "val_masked" not in self.task_list(), "--watch=True has no val_masked: drop it")
        require(self.batch_size >= 1, f"batch_size={self.batch_size} must be at least 1")
        require(
            self.split_tokens >= 0 and self.hellaswag_examples >= 0 and self.core_max_per_task >= 0,
            "split_tokens, hellaswag_examples and core_max_per_task must be >= 0 (0: all)",
        )
        require_choice("hellaswag_style", self.hellaswag_style, HELLASWAG_STYLES)

    def task_list(self):
        return [t.strip() for t in self.tasks.split(",") if t.strip()]


def _run_dataset(cfg):
    """The dataset directory for val and test: --dataset, else the run's own from its config.json."""
    if cfg.dataset:
        return os.path.join("data", cfg.dataset)
    if cfg.init_from == "resume":
        try:
            with open(os.path.join(cfg.out_dir, "config.json")) as f:
                return os.path.join("data", json.load(f)["dataset"])
        except (OSError, ValueError, KeyError):
            return None
    return None


def _plan(cfg, tok_spec, data_dir):
    """The tasks to run: --tasks, or by default all that apply to this model and data."""
    if cfg.tasks:
        if cfg.mc_path and "mc" not in cfg.task_list():
            raise UserError("--mc_path is set but --tasks lacks mc; add it to --tasks")
        return cfg.task_list()
    plan = [] if tok_spec["kind"] == "char" else ["hellaswag"]
    plan += ["mc"] if cfg.mc_path else []
    for split in ("val", "test"):
        if data_dir is not None and os.path.isdir(data_dir):
            try:
                token_files.split_paths(data_dir, split)
                plan.append(split)
            except UserError:
                pass
    if not plan:
        raise UserError(
            "nothing to evaluate: this model is character-level and no val/test data was found; "
            "name the data with --dataset"
        )
    return plan


def _check_same_tokenizer(data_dir, tok_spec):
    data_spec = tokenizer.describe(data_dir)
    key = ("kind", "name", "chars")
    if {k: data_spec.get(k) for k in key} != {k: tok_spec.get(k) for k in key}:
        raise UserError(
            f"{data_dir} was tokenized differently from this model ({data_spec['kind']} vs {tok_spec['kind']}); "
            f"evaluate it on data made with its own tokenizer"
        )


def main(argv=None):
    cfg = parse(EvalConfig, argv)
    if cfg.watch:
        return watch_run(cfg)
    rt = runtime.setup(cfg.device, cfg.dtype, cfg.backend)
    finished = False
    try:
        results = evaluate_all(cfg, rt)
        finished = True
    finally:
        runtime.teardown(rt, all_finished=finished)
    if rt.master and cfg.json:
        print(json.dumps(results))
    return 0


def watch_run(cfg):
    """--watch=True: every checkpoint of out_dir's run scored once as it lands, as --checkpoint=<it>
    would score it, until the run is over (gpt/evaluation/watch.py)."""
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        raise UserError("--watch=True runs in one process: start it with python, not torchrun")
    if not os.path.isdir(cfg.out_dir):
        raise UserError(f"out_dir={cfg.out_dir} does not exist; point --out_dir at a training run's directory")
    rt = runtime.setup(cfg.device, cfg.dtype, cfg.backend)
    score = lambda path: metrics.eval_record(
        evaluate_all(dataclasses.replace(cfg, checkpoint=os.path.basename(path)), rt)
    )
    try:
        result = watch.follow(cfg.out_dir, score)
    finally:
        runtime.teardown(rt, all_finished=True)
    print(watch.summary(result))
    return 0


def evaluate_all(cfg, rt):
    """Load the model, run each task, print a line per task; {task: results}."""
    say = print if rt.master else (lambda message: None)
    examples = {}  # the files of the tasks asked for are read first: a bad file should not wait for a model load
    if "hellaswag" in cfg.task_list():
        examples["hellaswag"] = tasks.load_hellaswag(cfg.hellaswag_path, cfg.hellaswag_examples, cfg.hellaswag_style)
    if cfg.mc_path:
        examples["mc"] = tasks.load_mc(cfg.mc_path)
    core_tasks = core.load_tasks(cfg.core_bundle, cfg.core_max_per_task) if "core" in cfg.task_list() else None
    model, tok_spec = load.for_inference(cfg.init_from, cfg.out_dir, cfg.checkpoint, report=say)
    model.eval().to(rt.device)
    block_size = model.config.block_size
    data_dir = _run_dataset(cfg)
    plan = _plan(cfg, tok_spec, data_dir)
    forward = torch.compile(model) if cfg.compile else model
    results = {}
    for task in plan:
        if task in ("hellaswag", "mc"):
            if task not in examples:  # hellaswag by default
                examples[task] = tasks.load_hellaswag(cfg.hellaswag_path, cfg.hellaswag_examples, cfg.hellaswag_style)
            joint = task == "hellaswag" and cfg.hellaswag_style == "harness"
            encoded = tasks.encode_examples(examples[task], tok_spec, task, joint=joint)
            r = results[task] = tasks.score_choices(forward, encoded, block_size, rt, cfg.batch_size, desc=task)
            if task == "hellaswag":
                r["style"] = cfg.hellaswag_style
            say(
                f"{task}{f' ({cfg.hellaswag_style} style)' if task == 'hellaswag' else ''}: acc {r['acc']:.4f}, "
                f"acc_norm_tokens {r['acc_norm_tokens']:.4f} (mean loss per token), "
                f"acc_norm_chars {r['acc_norm_chars']:.4f} (per character, lm-eval's acc_norm) ({r['n']:,} examples)"
            )
        elif task == "core":
            say(f"CORE: {len(core_tasks)} tasks, {sum(len(t.records) for t in core_tasks):,} examples")
            r = results[task] = core.evaluate_core(
                forward, core_tasks, tok_spec, block_size, rt, cfg.batch_size * block_size, report=say
            )
            say(
                f"CORE {r['core']:.4f} (mean centered accuracy of {len(r['tasks'])} tasks; "
                f"{r['examples']:,} examples, {r['examples_per_s']:.1f} examples/s)"
            )
        else:
            r = results[task] = _split(cfg, task, forward, model, tok_spec, data_dir, block_size, rt)
            bpb = f", {r['bpb']:.4f} bits per byte" if "bpb" in r else f", document-masked, {block_size}-token windows"
            say(f"{task}: loss {r['loss']:.4f}{bpb} ({r['tokens']:,} tokens of {data_dir})")
    return results


def _split(cfg, task, forward, model, tok_spec, data_dir, block_size, rt):
    split = task.removesuffix("_masked")
    if data_dir is None:
        raise UserError(f"--tasks has {task} but no data is known: name it with --dataset=NAME (data/NAME/{split}.bin)")
    _check_same_tokenizer(data_dir, tok_spec)
    data = token_files.Tokens.open(data_dir, split)
    data.check_vocab(model.config.vocab_size)
    if split != task:
        eot = tokenizer.eot(tok_spec)
        if eot is None:
            raise UserError(f"--tasks has {task}, which masks at end-of-text, and this model is character-level")
        return scoring.masked_loss(forward, data, block_size, rt, eot, cfg.batch_size, desc=task)
    return tasks.split_loss(
        forward, data, block_size, rt, tokenizer.token_bytes(tok_spec), cfg.batch_size, cfg.split_tokens, desc=task
    )


if __name__ == "__main__":
    run_main(main)
