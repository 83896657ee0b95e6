"""Train a GPT, on one device or many.

    python train.py config/train_shakespeare_char.py
    python train.py config/train_shakespeare_char.py --device=cpu --compile=False --max_iters=2000
    python train.py config/train_shakespeare_char.py --init_from=resume      # continue where it stopped
    python train.py config/train_shakespeare_char.py --init_from=auto        # resume if out_dir holds a run, else start
    torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py   # DDP on one node
    python train.py config/train_shakespeare_char.py --eval_async=True --keep_last=2   # a watcher scores each checkpoint
    python train.py --help                                                   # every key

The story of a run: main() reads the config, sets up the device and claims the out_dir; train()
loads the data (load_data), builds the Run (the model, what trains it, the batches, where it is,
the writers) and runs the loop, which evaluates and saves (evaluate_and_save), steps, and logs
(log_step). The pieces live in the library's folders: gpt/data (the batches), gpt/train (the
model as it trains, the step, the optimizers), gpt/outdir (checkpoints, saves, metrics), gpt/evaluation
(the evals), gpt/device (the runtime). Replica groups (torchft) are one object, gpt/train/replicas.py's, that does
nothing in a run without them; eval_async starts the watcher (gpt/evaluation/watch.py, eval.py --watch) as
a child process beside the run.
"""

import os
import time
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist

from configurator import TrainConfig, UserError, as_dict, parse, run_main
from gpt.data import batches, tokenizer
from gpt.device import runtime
from gpt.device.gpu_flops import device_peak_flops, mfu
from gpt.evaluation import scoring, tasks, watch
from gpt.evaluation.core import core_scores, load_tasks
from gpt.outdir import checkpoint, metrics, ownership
from gpt.outdir.saver import Checkpointer
from gpt.train import optim, replicas
from gpt.train.auto_batch import settle_batch_size
from gpt.train.build import build, make_model_args, uses_fsdp
from gpt.train.step import BadSteps, eval_group, evaluate, train_step
from gpt.train.stopping import StopRequest
from gpt.weights import load
from model import GPT, GPTConfig

EXIT_STOPPED = 75  # stopped early (SIGTERM, SIGINT, max_minutes) with a checkpoint: resume to go on


def main(argv=None):
    cfg = parse(TrainConfig, argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # checked before joining the process group
    if cfg.batch_size != "auto" and cfg.gradient_accumulation_steps % world_size:
        raise UserError(
            f"gradient_accumulation_steps={cfg.gradient_accumulation_steps} does not divide among "
            f"{world_size} processes; make it a multiple of {world_size}"
        )
    rt = runtime.setup(cfg.device, cfg.dtype, cfg.backend, cfg.dist_timeout_s)
    groups = replicas.of(cfg)  # this process's replica groups (torchft), or Alone
    cfg = groups.out_dir(cfg)  # each replica group writes its own out_dir/group<g>
    stop = StopRequest(cfg.max_minutes)
    finished, out, watcher = False, None, None
    try:
        out = ownership.claim(cfg, rt)  # the out_dir lock; a used out_dir refused; init_from='auto' resolved
        if cfg.eval_async and rt.master and not cfg.eval_only:
            watcher = watch.Child(watch.command(out.cfg), out.cfg.out_dir)
        code = train(out.cfg, rt, stop, out, groups, watcher)
        finished = True
        return code
    finally:
        stop.restore()
        runtime.teardown(rt, all_finished=finished)
        if out is not None:
            out.release()  # the watcher sees the run is over: it scores what is left, then exits
        if watcher is not None:
            watcher.finish()


# ---------------------------------------------------------------------------- setup


class Data(NamedTuple):
    train: object  # gpt.data.token_files.Tokens of each split, or batches.ChatData; test is None when there is none
    val: object
    test: object
    tok_spec: dict  # the tokenizer (tokenizer.py), saved in every checkpoint
    vocab_size: int
    hellaswag: Optional[list]  # encoded examples, when hellaswag_interval asks for them
    core: Optional[list]  # CORE's tasks (core.Task), when core_interval asks for them
    eot: Optional[int] = None  # the end-of-text id that ends each document: batch_order, doc_mask, eval_masked


def load_data(cfg, say):
    """The splits of data/<dataset>, checked against block_size and the vocabulary, and
    HellaSwag's examples and CORE's tasks, read now so a bad file is refused before training."""
    data_dir = os.path.join("data", cfg.dataset)  # an absolute dataset path is used as it is
    tok_spec = tokenizer.describe(data_dir)
    vocab_size = tokenizer.vocab_size(tok_spec) or 50304  # no meta: GPT-2 padded, as nanoGPT did
    splits = batches.open_splits(data_dir, tok_spec, vocab_size, cfg.block_size, cfg.data_mode, say)
    hellaswag = core = eot = None  # eval_async: HellaSwag and CORE are the watcher's
    if cfg.hellaswag_interval and not cfg.eval_async:
        examples = tasks.load_hellaswag(cfg.hellaswag_path, cfg.hellaswag_examples)
        hellaswag = tasks.encode_examples(examples, tok_spec)
    if cfg.core_interval and tok_spec["kind"] == "char":
        raise UserError(
            "core_interval needs a tokenizer that encodes any text; this data is character-level: set core_interval=0"
        )
    if cfg.core_interval and not cfg.eval_async:
        core = load_tasks(cfg.core_bundle, cfg.core_max_per_task)
    if cfg.batch_order == "documents" or cfg.doc_mask or cfg.eval_masked:
        eot = batches.end_of_text(cfg, tok_spec, data_dir)
    return Data(splits["train"], splits["val"], splits["test"], tok_spec, vocab_size, hellaswag, core, eot)


def make_model(cfg, rt, data, say):
    """(raw model on the device, its GPTConfig arguments, the checkpoint's state or None): from
    scratch, from the newest checkpoint in out_dir, or from pretrained weights."""
    model_args, state = make_model_args(cfg, data.vocab_size), None
    if cfg.init_from == "resume":
        state = checkpoint.load_newest(cfg.out_dir, report=say)
        model_args = checkpoint.resumable_model_args(state, cfg, model_args)
    if cfg.init_from in ("scratch", "resume"):
        raw_model = GPT(GPTConfig(**model_args))
    else:  # GPT-2's weights by name, or a Hugging Face GPT-2 or Llama directory; they fix the model's shape
        raw_model, model_args = load.for_training(cfg, data.tok_spec, report=say)
    return raw_model.to(rt.device), model_args, state


def where_it_stopped(state, train_batches, rt):
    """(iter_num, best_val_loss, the iter of that best (None in checkpoints from before it was
    kept), wandb_run_id, DiLoCo's outer state) of a resumed run's checkpoint, whose data order and
    random generators train_batches and the RNGs take up; a new run's start."""
    if state is None:
        return 0, float("inf"), None, None, None
    checkpoint.restore_rng(state, train_batches, rt)
    return (
        state["iter_num"],
        state["best_val_loss"],
        state.get("best_val_iter"),
        state.get("wandb_run_id"),
        state.get("outer"),
    )


def metrics_log(cfg, rt, out, resumed_at, wandb_run_id):
    """Rank 0's metrics.jsonl (with wandb and TensorBoard when asked for), beside the run's config."""
    if not rt.master:
        return None
    out.write_config(cfg)
    return metrics.MetricsLog(cfg.out_dir, resumed_at, cfg, wandb_run_id, path=out.path("metrics.jsonl"))


def checkpointer(cfg, rt, out):
    """The run's saves: full files, or sharded ones under FSDP2 (checkpoint_format='auto'); the
    rotation spares the checkpoints a watcher has yet to score."""
    fmt = cfg.checkpoint_format if cfg.checkpoint_format != "auto" else "sharded" if uses_fsdp(cfg, rt) else "full"
    # keep_last spares what a watcher (eval_async's, or one started by hand) has not scored
    spare = watch.Retention(cfg.out_dir, cfg.keep_unscored, child=cfg.eval_async)
    return Checkpointer(cfg.out_dir, fmt, cfg.keep_last, cfg.async_checkpoint, rt, on_commit=out.committed, spare=spare)


# ---------------------------------------------------------------------------- the run


class Run:
    """What the loop reads and updates: the model in its three forms, the optimizer, the data,
    where it is (iter_num, best_val_loss), the replica groups, and the log and checkpoint writers."""

    def __init__(self, cfg, rt, data, groups, out, say):
        raw_model, self.model_args, state = make_model(cfg, rt, data, say)
        cfg = settle_batch_size(cfg, raw_model, rt, state)  # batch_size='auto' is a number from here
        self.cfg, self.rt, self.data, self.raw_model, self.groups, self.say = cfg, rt, data, raw_model, groups, say
        self.accum_steps = cfg.gradient_accumulation_steps // (rt.world_size * groups.count)  # groups share it too
        self.tokens_per_iter = cfg.gradient_accumulation_steps * cfg.batch_size * cfg.block_size
        self.model, self.train_model, self.optimizer, self.scaler = build(raw_model, cfg, rt, state)
        self.chat = isinstance(data.train, batches.ChatData)
        self.batches = batches.for_training(data.train, cfg, groups.data_view(rt), self.accum_steps, data.eot, say)
        self.iter_num, self.best_val_loss, self.best_val_iter, wandb_run_id, outer = where_it_stopped(
            state, self.batches, rt
        )
        del state  # free the host copy of the weights
        groups.join(self, outer)  # replica groups: torchft's wrappers around train_model and the optimizer
        self.resumed_at = self.iter_num if cfg.init_from == "resume" else None  # no eval or save again at this iter
        splits = {"train": data.train, "val": data.val, "test": data.test}
        self.eval_splits = batches.eval_windows(splits, cfg.eval_iters, cfg.batch_size, cfg.block_size, cfg.seed)
        self.eval_bytes = tasks.eval_bytes(self.eval_splits, data.tok_spec, cfg.block_size, say)
        self.metrics = metrics_log(cfg, rt, out, self.resumed_at, wandb_run_id)  # rank 0's; None elsewhere
        self.saver = checkpointer(cfg, rt, out)
        self.bad = BadSteps(rt.device)
        self.throughput = metrics.Throughput(rt)
        self.flops_per_iter = raw_model.flops_per_token() * self.tokens_per_iter
        self.peak = device_peak_flops(rt, cfg.peak_flops)

    def save(self, best=False):
        """A checkpoint of this step (the keep_last history, ckpt_best when best), written now or in the background."""
        info = {
            "model_args": self.model_args,
            "config": as_dict(self.cfg),
            "tokenizer": self.data.tok_spec,
            "iter_num": self.iter_num,
            "best_val_loss": self.best_val_loss,
            "best_val_iter": self.best_val_iter,
            "wandb_run_id": self.metrics.wandb_run_id if self.rt.master else None,
            **self.groups.checkpoint(),  # replica groups' DiLoCo: its outer state
        }
        self.saver.save(
            self.raw_model, self.optimizer, self.scaler, uses_fsdp(self.cfg, self.rt), info, self.batches, best
        )

    def check_bad_steps(self):
        """The steps skipped since the last check, reported; Diverged (exit 3) at max_bad_steps in a row."""
        self.bad.check(self.iter_num, self.cfg.max_bad_steps, self.saver, self.say)


def train(cfg, rt, stop, out, groups, watcher=None):
    """Build the run and loop; returns the process exit code (0, or EXIT_STOPPED). watcher: eval_async's watch.Child."""
    started = time.perf_counter()
    torch.manual_seed(cfg.seed + rt.rank)
    say = print if rt.master else (lambda message: None)  # notes from the pieces below: rank 0 prints them
    run = Run(cfg, rt, load_data(cfg, say), groups, out, say)
    say(
        metrics.describe(
            run.cfg, rt, run.raw_model.num_params(), run.tokens_per_iter, run.accum_steps, groups.count, run.resumed_at
        )
    )
    note = optim.past_decay_note(run.cfg, run.iter_num)
    if note:
        say(note)
    try:
        code = loop(run, stop, watcher)
        if code == 0 and not cfg.eval_only:
            best = run.best_val_loss, run.best_val_iter
            say(
                metrics.finished_line(cfg.out_dir, run.iter_num, time.perf_counter() - started, *best, run.saver.latest)
            )
        return code
    finally:
        groups.shutdown()


def loop(run, stop, watcher=None):
    """Evaluate, save and step until max_iters or a stop request; returns the exit code."""
    cfg, rt = run.cfg, run.rt
    # The loop runs once more after the last step, so the final eval and save live in one place.
    while True:
        last = run.iter_num >= cfg.max_iters
        run.saver.poll()  # a background save that finished is committed here; one that failed stops the run
        if watcher is not None:
            watcher.check()  # eval_async: a watcher that died is started again (a poll(), no device sync)
        saved_now = evaluate_and_save(run, last)
        if cfg.eval_only:
            return 0
        if last or stop.check(rt):
            if not last:
                run.check_bad_steps()
            if not saved_now and run.iter_num != run.resumed_at:
                run.save()
            run.saver.wait()
            if last:
                return 0
            if rt.master:
                print(
                    f"stopped at iter {run.iter_num} ({stop.reason or 'another rank'}); {run.saver.latest} is current: "
                    f"continue with --init_from=resume"
                )
            return EXIT_STOPPED

        run.throughput.begin_step()
        lr = optim.schedule(run.optimizer, run.iter_num, cfg)  # Muon's momentum set on its groups
        ratio_due = rt.master and cfg.update_ratio_interval > 0 and run.iter_num % cfg.update_ratio_interval == 0
        before = optim.snapshot(run.raw_model) if ratio_due else None  # the N-th step only: off the hot path
        result = train_step(
            run.train_model, run.optimizer, run.scaler, run.batches, lr, run.accum_steps, cfg.grad_clip, rt
        )
        if ratio_due:
            run.metrics.write({"iter": run.iter_num, **optim.update_ratios(run.raw_model, before)})
        run.bad.record(result.stepped)
        run.throughput.end_step()
        if run.iter_num % cfg.log_interval == 0:
            log_step(run, result, lr)
        run.iter_num = run.groups.step_done(run.iter_num)  # a healed replica group jumps to its peers' step


def evaluate_and_save(run, last):
    """The eval losses when due and a checkpoint when val improved (or always, with
    always_save_checkpoint, or at the last step), then HellaSwag and CORE when due: after the
    step's checkpoint, so a downstream eval that fails costs no training. True when a checkpoint
    was written."""
    cfg, it = run.cfg, run.iter_num
    due = lambda interval: cfg.eval_only or ((it % interval == 0 or last) and it != run.resumed_at)
    evaluating = due(cfg.eval_interval)
    if evaluating or last:
        run.check_bad_steps()  # before a checkpoint can be written
    saved = evaluate_losses_and_save(run, last) if evaluating else False
    if last and not saved and not cfg.eval_only and it != run.resumed_at:
        run.save()  # the run's end is saved before its last downstream evals
        saved = True
    # on the plain model: HellaSwag's padded lengths vary, which a compiled one would recompile for
    model, rows, spec = run.raw_model, cfg.batch_size, run.data.tok_spec
    if run.data.hellaswag is not None and due(cfg.hellaswag_interval):
        downstream(
            run, "hellaswag", lambda: tasks.hellaswag_scores(model, run.data.hellaswag, cfg.block_size, run.rt, rows)
        )
    if run.data.core is not None and due(cfg.core_interval):
        downstream(
            run, "core", lambda: core_scores(model, run.data.core, spec, cfg.block_size, run.rt, rows * cfg.block_size)
        )
    return saved


def evaluate_losses_and_save(run, last):
    cfg, rt, it = run.cfg, run.rt, run.iter_num
    final = last or cfg.eval_only  # the test split is scored once, at the end
    splits = {k: v for k, v in run.eval_splits.items() if k != "test" or final}
    group = eval_group(cfg, run.raw_model.config.padded_vocab_size, rt.world_size)
    losses = evaluate(run.model, splits, cfg.block_size, rt, group)
    if cfg.eval_masked:  # the speedruns' val loss: all of val, document-masked
        masked = scoring.masked_loss(run.model, run.data.val, cfg.block_size, rt, run.data.eot, cfg.batch_size)
        losses["val_masked"] = masked["loss"]
    eval_tokens = cfg.eval_iters * cfg.batch_size * cfg.block_size
    bpb = (
        {k: tasks.bits_per_byte(losses[k], eval_tokens, run.eval_bytes[k]) for k in losses if k in run.eval_bytes}
        if run.eval_bytes is not None
        else {}
    )
    if rt.master:
        text = lambda k: f"{k} loss {losses[k]:.4f}" + (f" ({bpb[k]:.4f} bpb)" if k in bpb else "")
        print(f"step {it}: " + ", ".join(text(k) for k in ("train", "val", "val_masked", "test") if k in losses))
        run.metrics.write(
            {"iter": it, **{f"{k}_loss": v for k, v in losses.items()}, **{f"{k}_bpb": v for k, v in bpb.items()}}
        )
    run.throughput.restart()  # evaluation time is not training time
    if cfg.eval_only:
        return False
    improved = losses["val"] < run.best_val_loss
    if improved:
        run.best_val_loss, run.best_val_iter = losses["val"], it
    if it > 0 and (improved or cfg.always_save_checkpoint):
        run.save(best=improved)
        return True
    return False


def downstream(run, name, score):
    """One downstream eval of this step. Training goes on when it fails, out of memory included:
    what it held is freed, the model is put back in training mode, and the failure is one line
    and a metrics record ({name}_failed). Under torchrun a failure on one rank alone can leave the
    others waiting in the eval's all-reduce; there `python eval.py` on the checkpoint is the safe way."""
    cfg, rt, it = run.cfg, run.rt, run.iter_num
    try:
        results, line = score()  # (the scores, their log line)
    except Exception as e:  # noqa: BLE001 (any eval failure: the run matters more than one score)
        run.raw_model.train()
        if rt.device_type == "cuda":
            torch.cuda.empty_cache()
        if cfg.eval_only:
            raise
        why = str(e).strip().splitlines()[0] if str(e).strip() else ""
        message = f"{type(e).__name__}: {why}"[:300]
        if rt.master:
            print(f"step {it}: {name} failed, training goes on ({message})")
            run.metrics.write({"iter": it, f"{name}_failed": message})
    else:
        if rt.master:
            print(f"step {it}: {line}")
            run.metrics.write({"iter": it, **metrics.eval_record({name: results})})
    run.throughput.restart()


def log_step(run, result, lr):
    """The log line and metrics record of this step. Reading the loss waits for the device, so
    the window's time is real."""
    cfg, rt = run.cfg, run.rt
    run.check_bad_steps()
    loss = result.loss
    if rt.ddp:
        dist.all_reduce(loss)
        loss = loss / rt.world_size
    loss_value, norm_value = torch.stack([loss, result.grad_norm.float()]).tolist()
    dt, warm = run.throughput.read()
    # replica groups: only the groups that took part in the step trained tokens (the loss is this group's)
    tokens = run.tokens_per_iter * run.groups.participants / run.groups.count
    record = {
        "iter": run.iter_num,
        "loss": loss_value,
        "lr": lr,
        "grad_norm": norm_value,
        "clipped": cfg.grad_clip > 0 and norm_value > cfg.grad_clip,
        "dt_ms": dt * 1000,
        "tokens_per_s": tokens / dt,
        "mfu": mfu(run.flops_per_iter, dt, run.peak, rt.world_size) if warm else None,
        **run.groups.log(),
        **({"trained_tokens": run.batches.step_tokens} if run.chat else {}),
    }
    if rt.master:
        eta_s = dt * (cfg.max_iters - run.iter_num - 1)
        print(metrics.step_line(record, run.flops_per_iter / dt / 1e12 / rt.world_size, eta_s, run.groups.count))
        run.metrics.write(record)


if __name__ == "__main__":
    run_main(main)
