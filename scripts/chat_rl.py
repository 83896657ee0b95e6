"""Reinforcement learning on a chat model (the chat pipeline's last stage, after SFT): nanochat's
chat_rl. Each step samples a group of answers per problem, scores each with the task's checker,
and takes a policy-gradient step on the sampled tokens; pass@1..k on held-out problems is scored
every eval_interval steps.

    python scripts/chat_rl.py config/rl_demo_cpu.py                                   # the demo (make rl-demo)
    python scripts/chat_rl.py --start_from=out-chat --task=gsm8k --train_file=gsm8k/train.jsonl --test_file=gsm8k/test.jsonl
    python scripts/chat_rl.py --start_from=Llama-3.2-1B-Instruct --task=jsonl --train_file=mine.jsonl --test_file=held.jsonl --check=numeric
    python scripts/chat_rl.py config/rl_demo_cpu.py --init_from=auto                  # resume if out_dir holds a run, else start
    python scripts/chat_rl.py config/rl_demo_cpu.py --init_from=resume --eval_only=True   # pass@1..k of the run's newest checkpoint
    torchrun --standalone --nproc_per_node=8 scripts/chat_rl.py config/rl_demo_cpu.py --device=cuda   # problems split over the ranks
    python scripts/chat_rl.py --help                                                  # every key (train.py's too)

A run is a train.py run in everything but the step: out_dir's lock and init_from ('scratch': a
new run from start_from's weights, 'resume', 'auto'), atomic checkpoints (ckpt.pt; ckpt_best.pt
at the best pass@1), exact resume, metrics.jsonl (reward, pass@k, sampled lengths; python plot.py
OUT), SIGTERM's checkpoint and exit 75, DDP and FSDP2. The checkpoints are chat checkpoints:
chat.py, serve.py and hf.py read them. The library does the work: gpt/rl/tasks.py (the tasks
and checkers), gpt/rl/rollouts.py (sampling, the policy gradient, pass@k), gpt/train (the model
as it trains, the optimizer), gpt/outdir (the out_dir, checkpoints, metrics).
"""

import dataclasses
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from configurator import TrainConfig, UserError, as_dict, parse, require, run_main
from gpt.device import runtime
from gpt.outdir import checkpoint, metrics, ownership
from gpt.outdir.saver import Checkpointer
from gpt.rl import rollouts, tasks
from gpt.train import optim
from gpt.train.build import build, uses_fsdp
from gpt.train.stopping import StopRequest
from gpt.weights import load
from model import GPT, GPTConfig

EXIT_STOPPED = 75  # as train.py's: stopped with a checkpoint, resume to go on


@dataclass
class RLConfig(TrainConfig):
    # train.py's keys (out_dir, init_from, the optimizer and its schedule, device, ...) keep their
    # meaning; the model's shape and the data keys are the start's. What RL adds:
    # fmt: off
    start_from: str = ""  # the chat model to reinforce: an SFT run's out_dir (its best checkpoint) or a Hugging Face chat directory (Llama 3.2 Instruct)
    task: Literal["arithmetic", "gsm8k", "jsonl"] = "arithmetic"  # 'arithmetic' (generated from seed), 'gsm8k' (its jsonl: question, answer ending '#### N'; without files openai/gsm8k from the Hugging Face hub) or 'jsonl' (your prompt/answer lines, checked by check)
    train_file: str = ""  # gsm8k, jsonl: the training problems
    test_file: str = ""  # gsm8k, jsonl: the held-out problems pass@k is scored on
    check: Literal["exact", "numeric"] = "exact"  # task='jsonl': the completion equals the answer ('exact', stripped) or its last number does ('numeric')
    examples_per_step: int = 8  # problems per step, over all ranks (a multiple of the ranks)
    samples: int = 8  # answers sampled per problem: a group, whose mean reward is the baseline (at least 2)
    max_new_tokens: int = 64  # the longest answer sampled, in tokens
    temperature: float = 1.0  # sampling temperature of the rollouts and of pass@k
    top_k: Optional[int] = None  # sample from the k most likely tokens; None: all
    eval_examples: int = 100  # held-out problems pass@k is scored on (the first of the test set)
    pass_k: int = 8  # pass@1 .. pass@pass_k are scored, from pass_k samples per problem
    # train.py's keys whose defaults differ here
    out_dir: str = "out-rl"
    init_from: str = "scratch"  # 'scratch' (a new RL run from start_from), 'resume' or 'auto' (resume when out_dir holds a checkpoint, else a new run)
    max_iters: int = 100
    eval_interval: int = 20  # pass@k (and a checkpoint) every this many steps
    learning_rate: float = 1e-4
    min_lr: float = 0.0
    warmup_iters: int = 0
    lr_decay_iters: int = 100
    weight_decay: float = 0.0
    compile: bool = False
    # fmt: on

    def __post_init__(self):
        super().__post_init__()
        require(
            self.init_from in ("scratch", "resume", "auto"),
            f"init_from={self.init_from!r}: scripts/chat_rl.py takes 'scratch' (a new RL run), 'resume' or 'auto'; the model "
            f"it starts from is --start_from={self.init_from}",
        )
        require(
            self.samples >= 2,
            f"samples={self.samples}: a group of 1 sample per problem is its own baseline, so every advantage is 0 "
            f"and nothing is learned; sample at least 2 (nanochat: 16)",
        )
        for key in ("examples_per_step", "max_new_tokens", "eval_examples", "pass_k"):
            require(getattr(self, key) >= 1, f"{key}={getattr(self, key)} must be at least 1")
        require(self.temperature > 0, f"temperature={self.temperature}: rollouts sample, it must be > 0")


def main(argv=None):
    cfg = parse(RLConfig, argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    for key in ("examples_per_step", "eval_examples"):
        require(
            getattr(cfg, key) % world_size == 0,
            f"{key}={getattr(cfg, key)} must be a multiple of the {world_size} ranks",
        )
    rt = runtime.setup(cfg.device, cfg.dtype, cfg.backend, cfg.dist_timeout_s)
    stop = StopRequest(cfg.max_minutes)
    finished, out = False, None
    try:
        out = ownership.claim(cfg, rt)
        code = loop(Run(out.cfg, rt, out), stop)
        finished = True
        return code
    finally:
        stop.restore()
        runtime.teardown(rt, all_finished=finished)
        if out is not None:
            out.release()


# ---------------------------------------------------------------------------- setup


class Examples:
    """Which training problems step `it` samples: examples_per_step of them, through a seeded
    shuffle of the train set, epoch after epoch; the position is the step, so a checkpoint's
    iter_num is all a resume needs (state_dict: what the Checkpointer saves of the data)."""

    def __init__(self, n, per_step, seed):
        self.n, self.per_step, self.seed, self.orders = n, per_step, seed, {}

    def of_step(self, it, rt):
        """[(the problem's index in the step, its index in the train set)] of this rank's share."""
        out = []
        for j in range(rt.rank, self.per_step, rt.world_size):
            epoch, i = divmod(it * self.per_step + j, self.n)
            if epoch not in self.orders:
                self.orders = {epoch: random.Random(f"{self.seed} {epoch}").sample(range(self.n), self.n)}
            out.append((j, self.orders[epoch][i]))
        return out

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def load_policy(cfg, say):
    """(model, its GPTConfig arguments, tokenizer description, chat Template, the checkpoint's state or None)."""
    if cfg.init_from == "resume":
        state = checkpoint.load_newest(cfg.out_dir, report=say)
        model, tok_spec = GPT(GPTConfig(**state["model_args"])), state["tokenizer"]
        where = cfg.out_dir
    else:
        if not cfg.start_from:
            raise UserError(
                f"no chat model to start from: set --start_from to an SFT run's out_dir or a Hugging Face chat "
                f"directory (out_dir={cfg.out_dir} holds no RL run to resume)"
            )
        state, where = None, cfg.start_from
        model, tok_spec = load.for_inference(cfg.start_from, None, "best", report=say)
    template = load.chat_template(model.config.vocab_size, tok_spec, "resume" if state else cfg.start_from, where)
    return model, dataclasses.asdict(model.config), tok_spec, template, state


class Run:
    """What the loop reads and updates: the model, optimizer, task, data order, where it is, the writers."""

    def __init__(self, cfg, rt, out):
        self.say = say = print if rt.master else (lambda message: None)
        torch.manual_seed(cfg.seed + rt.rank)
        self.task = tasks.load(cfg.task, cfg.train_file, cfg.test_file, cfg.check, cfg.seed)
        raw_model, self.model_args, self.tok_spec, self.template, state = load_policy(cfg, say)
        longest = max(len(self.prompt(p)) for p in self.task.train + self.task.test)
        if longest + cfg.max_new_tokens > raw_model.config.block_size:
            raise UserError(
                f"the longest prompt ({longest} tokens) and max_new_tokens={cfg.max_new_tokens} do not fit the model's "
                f"block_size={raw_model.config.block_size}; lower max_new_tokens or shorten the prompts"
            )
        self.model_args["dropout"] = cfg.dropout
        self.raw_model = raw_model.to(rt.device)
        self.cfg, self.rt = cfg, rt
        _, self.train_model, self.optimizer, self.scaler = build(self.raw_model, cfg, rt, state)
        self.examples = Examples(len(self.task.train), cfg.examples_per_step, cfg.seed)
        self.iter_num = state["iter_num"] if state else 0
        self.best = state.get("best_pass1", -1.0) if state else -1.0
        if state:
            checkpoint.restore_rng(state, self.examples, rt)
        self.resumed_at = self.iter_num if state else None
        del state
        if rt.master:
            out.write_config(cfg)
        self.metrics = (
            metrics.MetricsLog(cfg.out_dir, self.resumed_at, cfg, path=out.path("metrics.jsonl")) if rt.master else None
        )
        fmt = cfg.checkpoint_format if cfg.checkpoint_format != "auto" else "sharded" if uses_fsdp(cfg, rt) else "full"
        self.saver = Checkpointer(cfg.out_dir, fmt, cfg.keep_last, cfg.async_checkpoint, rt, on_commit=out.committed)
        self.every_step = uses_fsdp(cfg, rt)  # FSDP's ranks gather the weights together at every forward pass
        resuming = f", resuming at iter {self.resumed_at}" if self.resumed_at is not None else ""
        say(
            f"rl: task {cfg.task} ({len(self.task.train):,} train, {len(self.task.test):,} test problems), "
            f"{cfg.examples_per_step} problems x {cfg.samples} samples a step over {rt.world_size} rank(s), "
            f"{raw_model.num_params() / 1e6:.2f}M parameters, {rt.device}{resuming}"
        )

    def prompt(self, problem):
        return self.template.render([{"role": "user", "content": problem.prompt}], add_generation_prompt=True)[0]

    def save(self, best=False):
        info = {
            "model_args": self.model_args,
            "config": as_dict(self.cfg),
            "tokenizer": self.tok_spec,
            "iter_num": self.iter_num,
            "best_val_loss": float("inf"),  # no val loss in RL: ckpt_best is the best pass@1's
            "best_val_iter": None,
            "best_pass1": self.best,
            "wandb_run_id": None,
        }
        self.saver.save(
            self.raw_model, self.optimizer, self.scaler, uses_fsdp(self.cfg, self.rt), info, self.examples, best
        )


# ---------------------------------------------------------------------------- the loop


def loop(run, stop):
    """Evaluate and save when due, then step, until max_iters or a stop request; the exit code."""
    cfg, rt = run.cfg, run.rt
    while True:
        last = run.iter_num >= cfg.max_iters
        run.saver.poll()
        due = (run.iter_num % cfg.eval_interval == 0 or last) and run.iter_num != run.resumed_at
        if due or cfg.eval_only:
            passed = evaluate(run)
            if cfg.eval_only:  # pass@k of the start (a new run) or of out_dir's newest checkpoint (resume)
                return 0
            if run.iter_num > 0 or last:
                run.save(best=passed)
        if last or stop.check(rt):
            if not due and run.iter_num != run.resumed_at:
                run.save()
            run.saver.wait()
            if last:
                run.say(
                    f"done: {cfg.max_iters} steps; the checkpoint is {run.saver.latest} (chat.py --out_dir={cfg.out_dir})"
                )
                return 0
            run.say(
                f"stopped at iter {run.iter_num} ({stop.reason or 'another rank'}); continue with --init_from=resume"
            )
            return EXIT_STOPPED
        step(run)
        run.iter_num += 1


def evaluate(run):
    """pass@1..pass_k on the first eval_examples test problems, logged; True when pass@1 is the best yet."""
    cfg, rt = run.cfg, run.rt
    run.raw_model.eval()
    started = time.perf_counter()
    problems = run.task.test[: cfg.eval_examples]
    with rt.autocast():
        scores = rollouts.evaluate(
            run.raw_model,
            run.template,
            run.task,
            problems,
            cfg.pass_k,
            cfg.max_new_tokens,
            cfg.temperature,
            cfg.top_k,
            cfg.seed,
            rt,
            run.every_step,
        )
    run.raw_model.train()
    improved = scores["pass@1"] > run.best
    run.best = max(run.best, scores["pass@1"])
    if rt.master:
        text = ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
        run.say(
            f"step {run.iter_num}: {len(problems)} held-out problems: {text} ({time.perf_counter() - started:.1f} s)"
        )
        run.metrics.write({"iter": run.iter_num, **scores})
    return improved


def step(run):
    """Sample this rank's groups, then one policy-gradient step; the step's record."""
    cfg, rt = run.cfg, run.rt
    started = time.perf_counter()
    run.raw_model.eval()  # sampling: no dropout
    groups = []
    with rt.autocast():
        for j, i in run.examples.of_step(run.iter_num, rt):
            seed = rollouts.seed_of(cfg.seed, run.iter_num, j)
            groups.append(
                rollouts.rollout(
                    run.raw_model,
                    run.template,
                    run.task,
                    run.task.train[i],
                    cfg.samples,
                    cfg.max_new_tokens,
                    cfg.temperature,
                    cfg.top_k,
                    seed,
                    run.every_step,
                )
            )
    run.raw_model.train()
    sampled = time.perf_counter() - started
    # the step's sums over every rank: sampled tokens, rewards, samples that passed
    sums = torch.tensor(
        [
            sum(sum(g.lengths) for g in groups),
            sum(sum(g.rewards) for g in groups),
            float(sum(len(g.lengths) for g in groups)),
        ],
        dtype=torch.float64,
    )
    if rt.ddp:
        sums = sums.to(rt.device)
        dist.all_reduce(sums)
        sums = sums.cpu()
    tokens, reward, n = sums.tolist()
    lr = optim.get_lr(run.iter_num, cfg)
    loss, norm = rollouts.policy_step(
        run.train_model, run.optimizer, run.scaler, groups, lr, cfg.grad_clip, rt, max(tokens, 1.0)
    )
    if rt.ddp:
        dist.all_reduce(loss)
    if run.iter_num % cfg.log_interval == 0 and rt.master:
        dt = time.perf_counter() - started
        record = {
            "iter": run.iter_num,
            "loss": loss.item(),
            "reward": reward / n,
            "sampled_tokens": int(tokens),
            "sampled_length": tokens / n,
            "lr": lr,
            "grad_norm": norm.item(),
            "dt_ms": dt * 1000,
            "tokens_per_s": tokens / sampled,  # sampled tokens a second, every rank's
        }
        print(
            f"iter {run.iter_num}: reward {record['reward']:.3f}, loss {record['loss']:.4f}, sampled length "
            f"{record['sampled_length']:.1f}, lr {lr:.2e}, grad norm {record['grad_norm']:.3g}, {dt * 1000:.0f} ms, "
            f"{record['tokens_per_s']:,.0f} sampled tok/s"
        )
        run.metrics.write(record)


if __name__ == "__main__":
    run_main(main)
