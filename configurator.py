"""Typed configuration: defaults in one dataclass, then config files, then --key=value.

    python train.py config/train_shakespeare_char.py --device=cpu --compile=False
    python train.py --help          # every key, its default and what it does
    python sample.py --help

A config file is plain Python assignments (`batch_size = 32`), run in a namespace of
its own. Values on the command line parse as Python literals, so `--dropout=0`,
`--compile=False` and `--device=cpu` all mean what they say. Mistakes stop the
program with one line naming the key or file and exit code 2, never a traceback.
"""

import argparse
import ast
import dataclasses
import difflib
import inspect
import os
import re
import sys
import traceback
import types
import typing
from dataclasses import dataclass
from typing import Literal, Optional, Union


class UserError(Exception):
    """A mistake in the user's input: reported in one line, no traceback."""

    exit_code = 2


def run_main(main):
    """Run an entry point and exit with its return code; a UserError becomes one line on stderr
    and a non-zero exit."""
    try:
        try:
            code = main()
        finally:
            sys.stdout.flush()  # here, so that a reader gone away is caught below and not at exit
    except BrokenPipeError:
        # stdout's reader stopped reading (`python train.py --help | head -5`): end quietly, as a
        # Unix tool killed by SIGPIPE does (141), with stdout on /dev/null so exit's flush cannot fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except UserError as e:
        # one write, so the lines of several ranks refusing at once do not interleave
        sys.stderr.write(f"error: {e}\n")
        sys.stderr.flush()
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code or 0)


class Parser(argparse.ArgumentParser):
    """The argparse parser of the commands and scripts that take their flags with argparse (plot.py,
    data/'s preparation, scripts/): a bad flag is one line, as the config's keys are, not argparse's
    usage block. Run their main under run_main, which prints it and exits 2."""

    def error(self, message):
        raise UserError(f"{message}; see --help")


AT_LEAST_ONE = (
    "block_size n_layer n_head n_embd gradient_accumulation_steps eval_interval log_interval eval_iters".split()
)


@dataclass
class TrainConfig:
    # I/O
    # one line per key, its trailing comment the key's --help text
    # fmt: off
    out_dir: str = "out"  # checkpoints, config.json and metrics.jsonl are written here
    eval_interval: int = 2000  # evaluate (and maybe checkpoint) every this many iterations
    log_interval: int = 1  # print and record training metrics every this many iterations
    update_ratio_interval: int = 0  # every this many steps log each layer's |update| / |weight| (one copy of the weights that step); 0: off
    eval_iters: int = 200  # batches per split in each evaluation (the same batches every time)
    eval_only: bool = False  # evaluate once, then exit
    eval_masked: bool = False  # each eval also scores all of val document-masked in consecutive block_size windows, as val_masked_loss: the speedruns' val loss (docs/speedrun.md)
    hellaswag_interval: int = 0  # score HellaSwag every this many iterations (eval.py); 0: off. Needs a tokenizer that encodes text
    hellaswag_examples: int = 0  # score this fixed subset of HellaSwag (a seeded sample) for speed; 0: all 10,042
    hellaswag_path: str = ""  # a HellaSwag jsonl (ctx, endings, label); '': data/hellaswag/hellaswag_val.jsonl, downloaded once
    core_interval: int = 0  # score CORE (eval.py --tasks=core) every this many iterations; 0: off. Needs a tokenizer that encodes text
    core_max_per_task: int = 100  # CORE in the loop: this many examples per task, the same ones every time; 0: all (~90k examples)
    core_bundle: str = ""  # the CORE eval bundle (a directory or zip); '': data/core/eval_bundle.zip, downloaded once
    eval_async: bool = False  # score each checkpoint in a watcher process beside the run (eval.py --watch): val, test, and HellaSwag/CORE when their interval is set; the loop then runs no HellaSwag or CORE itself (docs/watch.md)
    eval_async_device: str = "cpu"  # the watcher's device: 'cpu', 'cuda:7' (a GPU training does not use), 'mps', 'auto'
    keep_unscored: int = 4  # while a watcher follows the run (eval_async, or eval.py --watch beside it): checkpoints past keep_last it has not scored are kept, this many at most (the one being scored first, then the newest); older ones are removed and logged as skipped
    always_save_checkpoint: bool = True  # write ckpt.pt at every eval, not only when val improves
    keep_last: int = 1  # checkpoints kept: ckpt.pt is the newest; with N > 1 the N newest also stay as ckpt_<iter>.pt
    checkpoint_format: Literal["auto", "full", "sharded"] = "auto"  # 'full' (one file, ckpt.pt), 'sharded' (a directory ckpt_<iter>/ of per-rank shards) or 'auto' (sharded under FSDP, else full)
    async_checkpoint: bool = False  # write checkpoints in the background while training goes on (state copied to host memory first)
    init_from: str = "scratch"  # 'scratch', 'resume' (the newest complete checkpoint in out_dir), 'auto' (resume when out_dir holds a checkpoint, else scratch: for requeued jobs), 'gpt2'/'gpt2-medium'/'gpt2-large'/'gpt2-xl', a Hugging Face GPT-2 or Llama directory, or another run's out_dir (its best weights, a fresh optimizer: e.g. fine-tune after pretraining)
    overwrite: bool = False  # let a new run (not resume) start in an out_dir that holds a checkpoint; the old run is replaced at the new one's first checkpoint
    max_minutes: float = 0.0  # stop after this many minutes with a checkpoint (exit code 75); 0: no limit
    max_bad_steps: int = 10  # stop when this many steps in a row have a non-finite loss or gradient norm
    # wandb (imported only when wandb_log=True)
    wandb_log: bool = False  # send metrics to Weights & Biases
    wandb_project: str = "owt"  # wandb project name
    wandb_run_name: str = "gpt2"  # wandb run name
    tensorboard_log: bool = False  # also write TensorBoard event files to out_dir/tensorboard
    # data
    dataset: str = "openwebtext"  # reads data/<dataset>/train.bin and val.bin (or their shards, or llm.c's: docs/data.md); an absolute path as it is
    gradient_accumulation_steps: int = 5 * 8  # micro-steps per optimizer step, summed over all ranks
    batch_size: Union[int, Literal["auto"]] = 12  # micro-batch per rank, or 'auto': the largest that fits (needs total_batch_size)
    total_batch_size: int = 0  # tokens per optimizer step that batch_size='auto' keeps fixed (0: not used)
    memory_budget_gb: float = 0.0  # memory batch_size='auto' may fill; 0: the GPU's memory, or half the free RAM on CPU
    block_size: int = 1024  # context length in tokens
    data_mode: Literal["auto", "ram", "memmap"] = "auto"  # 'ram', 'memmap', or 'auto' (RAM when the files are small against free memory)
    seed: int = 1337  # seeds init, dropout and the batch order; a resumed run keeps its own RNG state
    # document-aligned batches (docs/data.md): token data whose documents end with end-of-text
    batch_order: Literal["random", "documents"] = "random"  # 'random': windows at random offsets; 'documents': rows that start at a document, each once per epoch
    doc_mask: bool = False  # attention stays inside each document of a row, whose positions restart at 0 (train batches only)
    # model: GPTConfig's keys, each described once, on GPTConfig in model.py (--help shows it there too)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False
    pos_encoding: Literal["learned", "rope"] = "learned"
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    mlp: Literal["gelu", "gelu_tanh", "swiglu", "relu2"] = "gelu"
    mlp_hidden: int = 0
    n_kv_head: int = 0
    qk_norm: bool = False
    tie_embeddings: bool = True
    # speedrun levers (GPTConfig's keys too; described there)
    zero_init_proj: bool = False
    logit_softcap: float = 0.0
    value_embeds: bool = False
    unet_skips: bool = False
    # optimizer
    learning_rate: float = 6e-4  # peak learning rate (with optimizer=muon: AdamW's part; Muon's is muon_lr)
    max_iters: int = 600000  # total optimizer steps
    weight_decay: float = 1e-1  # applied to matrices and embeddings only
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 disables
    optimizer: Literal["adamw", "muon"] = "adamw"  # 'adamw' (every parameter) or 'muon': Muon for the blocks' weight matrices, AdamW for the rest
    muon_lr: float = 0.02  # Muon's peak learning rate; the schedule scales it as it scales learning_rate
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    muon_weight_decay: float = 0.0  # Muon's decoupled weight decay (each step multiplies the matrices by 1 - lr * this)
    muon_polar_express: bool = False  # Muon's iterations with Polar Express's five quintics (each its own), not torch's one five times
    muon_normuon: bool = False  # NorMuon: each neuron's update divided by its running RMS, the matrix's norm kept (not under FSDP)
    muon_cautious_wd: bool = False  # Muon's weight decay only where the update and the weight agree in sign
    muon_momentum_warmup: int = 0  # steps over which Muon's momentum climbs linearly from muon_momentum_start to muon_momentum (modded-nanogpt: 300); 0: off
    muon_momentum_start: float = 0.85  # muon_momentum_warmup: Muon's momentum at step 0
    muon_momentum_cooldown: float = 0.0  # lr_schedule='wsd': Muon's momentum at max_iters, reached linearly over the decay (e.g. 0.85); 0: off
    # learning-rate schedule
    decay_lr: bool = True  # a linear warmup, then lr_schedule's decay; False keeps learning_rate fixed
    warmup_iters: int = 2000  # linear warmup steps
    lr_decay_iters: int = 600000  # step at which the cosine reaches min_lr (usually max_iters)
    min_lr: float = 6e-5  # floor of the schedule (about learning_rate / 10)
    lr_schedule: Literal["cosine", "wsd"] = "cosine"  # 'cosine' (to min_lr at lr_decay_iters) or 'wsd': constant, then linear to min_lr over the last decay_frac of max_iters
    decay_frac: float = 0.2  # lr_schedule='wsd': the fraction of max_iters spent decaying, in (0, 1]
    # system
    backend: Literal["auto", "nccl", "gloo"] = "auto"  # torch.distributed backend: 'nccl', 'gloo', or 'auto' (nccl on CUDA, else gloo)
    dist_timeout_s: int = 600  # under torchrun: a rank waiting this long to join the group, or in any collective, fails instead of hanging (torchrun then restarts the job or stops)
    device: str = "auto"  # 'auto' (cuda, else mps, else cpu), 'cpu', 'cuda', 'cuda:1', 'mps'
    dtype: str = "auto"  # 'auto', 'float32', 'bfloat16' or 'float16' (float16 uses a GradScaler)
    compile: bool = True  # torch.compile the model (slow to start, faster per step on GPUs)
    fp8: Union[bool, Literal["emulate"]] = False  # the blocks' Linear layers in float8 (torchao, tensorwise scaling): needs an NVIDIA GPU of compute capability 8.9+ (H100, L4, RTX 4090) and compile=True; 'emulate': float8's rounding with high-precision matmuls, on any device (docs/fp8.md)
    fp8_skip: str = "lm_head"  # fp8: the Linear layers kept as they are, comma-separated parts of their names, e.g. 'lm_head,transformer.h.0.'; '': lm_head in float8 too
    parallelism: Literal["ddp", "fsdp"] = "ddp"  # under torchrun: 'ddp' (a full copy per rank) or 'fsdp' (weights, grads, AdamW state sharded)
    activation_checkpointing: bool = False  # recompute each block's activations in backward: less memory, ~1/3 more compute
    peak_flops: float = 0.0  # the device's dense peak FLOP/s for MFU (e.g. 989e12); 0: look it up by GPU name
    attention: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"  # SDPA kernel: 'auto' (PyTorch's choice), 'flash', 'cudnn', 'efficient' or 'math'
    # fault-tolerant replica groups (torchft; docs/fault_tolerance.md)
    ft_replica_group: int = -1  # this process's replica group, 0..ft_groups-1; -1: off. A group is one process or a torchrun job (DDP inside), writing out_dir/group<g>
    ft_groups: int = 2  # replica groups expected; gradient_accumulation_steps is summed over them, and group g draws slice g of the global batch
    ft_min_groups: int = 1  # a step commits only when at least this many groups take part
    ft_lighthouse: str = ""  # the torchft lighthouse's address, e.g. http://host:29510; '': the TORCHFT_LIGHTHOUSE environment variable
    # DiLoCo / LocalSGD on the replica groups (torchft; docs/fault_tolerance.md)
    sync_every: int = 0  # H: each group steps alone and the groups sync every H steps (outer_method); 0: gradients averaged every step
    outer_method: Literal["diloco", "localsgd"] = "diloco"  # sync_every: 'diloco' (outer SGD on the averaged change of the weights since the last sync) or 'localsgd' (the weights averaged)
    outer_lr: float = 0.7  # DiLoCo's outer learning rate
    outer_momentum: float = 0.9  # DiLoCo's outer Nesterov momentum (0: plain SGD)
    # fmt: on

    def __post_init__(self):
        require_choices(self)
        for key in AT_LEAST_ONE:
            require(getattr(self, key) >= 1, f"{key}={getattr(self, key)} must be at least 1")
        if self.batch_size == "auto":
            require(
                self.total_batch_size > 0 and self.total_batch_size % self.block_size == 0,
                "batch_size='auto' keeps the tokens per optimizer step fixed: set total_batch_size "
                f"to a multiple of block_size={self.block_size}, e.g. --total_batch_size={40 * 12 * self.block_size}",
            )
        else:
            require(self.batch_size >= 1, f"batch_size={self.batch_size} must be at least 1, or 'auto'")
        require(self.max_iters >= 0, f"max_iters={self.max_iters} must not be negative")
        require(
            self.hellaswag_interval >= 0 and self.hellaswag_examples >= 0,
            "hellaswag_interval and hellaswag_examples must be >= 0 (0: off, and all examples)",
        )
        require(
            self.core_interval >= 0 and self.core_max_per_task >= 0,
            "core_interval and core_max_per_task must be >= 0 (0: off, and all examples)",
        )
        require(self.max_minutes >= 0 and self.max_bad_steps >= 1, "max_minutes must be >= 0 and max_bad_steps >= 1")
        require(self.keep_last >= 1, f"keep_last={self.keep_last} must be at least 1 (ckpt.pt is always kept)")
        require(
            self.keep_unscored >= 0,
            f"keep_unscored={self.keep_unscored} must be >= 0 (0: the watcher scores what keep_last keeps)",
        )
        require(
            self.fp8 is not True or self.compile,
            "fp8=True needs compile=True: unfused by torch.compile, torchao's float8 casts and scales cost more than "
            "FP8 saves; set --compile=True, or --fp8=emulate to check float8's numerics uncompiled",
        )
        self._check_model()
        self._check_optimizer()
        self._check_run()

    def _check_model(self):
        """The network's shape: what model.py can build."""
        require(
            self.n_embd % self.n_head == 0,
            f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; each head gets n_embd/n_head dims",
        )
        require(0 <= self.dropout < 1, f"dropout={self.dropout} must be in [0, 1)")
        require(
            0 <= self.n_kv_head <= self.n_head and self.n_head % (self.n_kv_head or self.n_head) == 0,
            f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head} (each k/v head serves a whole group "
            f"of query heads); 0 means n_head",
        )
        require(
            self.pos_encoding != "rope" or self.n_embd // self.n_head % 2 == 0,
            f"pos_encoding='rope' rotates pairs of dims: the head size n_embd/n_head={self.n_embd // self.n_head} must be even",
        )
        require(
            self.rope_theta > 0 and self.mlp_hidden >= 0,
            "rope_theta must be > 0 and mlp_hidden >= 0 (0: the usual width)",
        )
        require_rope_scaling(self.rope_scaling, self.pos_encoding)
        require(self.norm_eps > 0, f"norm_eps={self.norm_eps} must be > 0")
        require(self.logit_softcap >= 0, f"logit_softcap={self.logit_softcap} must be >= 0 (0: off; e.g. 15 or 30)")

    def _check_optimizer(self):
        """The optimizer and its schedule."""
        require(self.learning_rate > 0 and self.min_lr >= 0, "learning_rate must be > 0 and min_lr >= 0")
        require(self.grad_clip >= 0, f"grad_clip={self.grad_clip} must be >= 0 (0 disables clipping)")
        require(
            not self.decay_lr or self.lr_schedule == "wsd" or self.lr_decay_iters > self.warmup_iters >= 0,
            f"lr_decay_iters={self.lr_decay_iters} must be larger than warmup_iters={self.warmup_iters}",
        )
        require(
            0 < self.decay_frac <= 1,
            f"decay_frac={self.decay_frac} must be in (0, 1]: the fraction of max_iters spent decaying",
        )
        momenta = (self.muon_momentum, self.muon_momentum_start, self.muon_momentum_cooldown)
        require(
            self.muon_lr > 0 and all(0 <= m < 1 for m in momenta) and self.muon_weight_decay >= 0,
            "muon_lr must be > 0, muon_momentum, muon_momentum_start and muon_momentum_cooldown in [0, 1) "
            "and muon_weight_decay >= 0",
        )
        require(
            self.muon_momentum_warmup >= 0, f"muon_momentum_warmup={self.muon_momentum_warmup} must be >= 0 (0: off)"
        )
        require(
            not self.muon_momentum_cooldown or self.lr_schedule == "wsd",
            "muon_momentum_cooldown ramps Muon's momentum down over lr_schedule='wsd''s decay: set --lr_schedule=wsd",
        )
        muon_keys = (
            "muon_polar_express muon_normuon muon_cautious_wd muon_momentum_warmup muon_momentum_cooldown".split()
        )
        levers = [k for k in muon_keys if getattr(self, k)]
        require(
            self.optimizer == "muon" or not levers,
            f"{levers[0] if levers else ''}={getattr(self, levers[0]) if levers else ''} is a lever of Muon, which "
            f"optimizer={self.optimizer!r} does not run; set optimizer='muon' or drop it",
        )
        require(
            self.update_ratio_interval >= 0, f"update_ratio_interval={self.update_ratio_interval} must be >= 0 (0: off)"
        )
        require(
            self.update_ratio_interval == 0 or self.parallelism != "fsdp",
            "update_ratio_interval needs whole weights, which parallelism='fsdp' shards; set it to 0 under FSDP",
        )

    def _check_run(self):
        """Where the run starts, its data, and its processes (torchrun, replica groups)."""
        require_init_from(self.init_from, ("scratch", "resume", "auto"))
        require(
            not self.overwrite or self.init_from not in ("resume", "auto"),
            f"overwrite=True replaces the run in out_dir, init_from={self.init_from!r} continues it: drop one of the two",
        )
        if self.ft_replica_group >= 0:
            require(
                1 <= self.ft_min_groups <= self.ft_groups and self.ft_replica_group < self.ft_groups,
                f"ft_replica_group={self.ft_replica_group} must be below ft_groups={self.ft_groups}, and ft_min_groups="
                f"{self.ft_min_groups} between 1 and ft_groups",
            )
            require(
                self.batch_size != "auto" and self.gradient_accumulation_steps % self.ft_groups == 0,
                f"replica groups share gradient_accumulation_steps={self.gradient_accumulation_steps}: make it a multiple "
                f"of ft_groups={self.ft_groups}, with a fixed batch_size",
            )
            require(
                self.parallelism == "ddp",
                "a replica group runs DDP inside (FSDP2 is not built for replica groups here): use parallelism='ddp'",
            )
        require(
            self.sync_every == 0 or (self.sync_every > 0 and self.ft_replica_group >= 0),
            f"sync_every={self.sync_every} syncs replica groups every that many steps: set --ft_replica_group too (0: every step)",
        )
        require(self.dist_timeout_s > 0, f"dist_timeout_s={self.dist_timeout_s} must be a positive number of seconds")


@dataclass
class BenchConfig(TrainConfig):
    # every train.py key, plus what bench.py measures and how
    # one line per key, its trailing comment the key's --help text
    # fmt: off
    data: str = "synthetic"  # 'synthetic' (random tokens, no files needed) or 'real' (data/<dataset>/train.bin)
    bench_iters: int = 20  # timed optimizer steps
    bench_warmup: int = 5  # untimed steps first: compilation, autotuning, allocator warm-up
    sweep: str = ""  # 'key=v1,v2,...', e.g. 'batch_size=4,8,16,32' (same tokens per step: accumulation adjusts)
    profile: bool = False  # write a torch.profiler trace (TensorBoard, Chrome) to out_dir/profile
    profile_wait: int = 1  # profiler schedule: steps skipped,
    profile_warmup: int = 1  # steps traced but discarded,
    profile_active: int = 3  # and steps recorded
    json: bool = False  # print the results as one JSON object on the last line
    estimate_params: float = 0.0  # time-to-train: parameters of the model to train (0: this config's model)
    estimate_tokens: float = 0.0  # time-to-train: its training tokens (0: 20 per parameter)
    # comparison: setting `against` trains two configurations with several seeds each and tests the difference (gpt/evaluation/compare.py)
    compare: str = ""  # side A: train.py arguments (config files, --key=value) after this command's own, e.g. '--optimizer=adamw'; '': this command's config as it is
    against: str = ""  # side B, the same way, e.g. '--mlp=swiglu'; set, bench.py compares A with B instead of timing a step
    seeds: Union[int, list, tuple] = 5  # the seeds each side trains with: N means 1..N, or the seeds themselves (--seeds=1,2,3): side A's; side B's are as many after A's largest (independent samples)
    target: float = 0.0  # also report the iterations and the training time to the loop's first eval with val loss <= this; 0: off
    compare_dir: str = "out-compare"  # each run's out_dir (<A|B>-s<seed>) and its log, compare.md, compare.json, compare.png
    compare_eval_tokens: int = 0  # every run's final checkpoint is scored on this many tokens from val's start, the same for all; 0: all of val
    # fmt: on

    def __post_init__(self):
        super().__post_init__()
        require(
            not self.compare or self.against, f"compare={self.compare!r} names side A; name side B with --against=..."
        )
        seeds = self.seeds
        if isinstance(seeds, int):
            require(
                seeds >= 1, f"seeds={seeds} must be at least 1 (a count), or the seeds themselves, e.g. --seeds=1,2,3"
            )
        else:
            require(
                seeds and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds),
                f"seeds={seeds!r} must be a count or whole numbers, e.g. --seeds=1,2,3",
            )
            require(
                len(set(seeds)) == len(seeds),
                f"seeds={seeds!r} repeats a seed: a repeat with the same seed is the same run "
                f"again, not another sample; give distinct seeds",
            )
        require(
            self.target >= 0 and self.compare_eval_tokens >= 0,
            "target and compare_eval_tokens must be >= 0 (0: off, and all of val)",
        )


GPT2_MODELS = (
    "gpt2",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
)  # released weights init_from can name (gpt/weights/huggingface.py)


def require(ok, message):
    if not ok:
        raise UserError(message)


def require_choices(cfg):
    """Each key typed Literal[...] holds one of its choices, also in a config built in code."""
    for f in dataclasses.fields(cfg):
        if typing.get_origin(f.type) is Literal:
            require_choice(f.name, getattr(cfg, f.name), typing.get_args(f.type))


def require_choice(key, value, choices):
    require(value in choices, f"{key}={value!r} is not one of {', '.join(map(repr, choices))}")


def require_sampling(cfg):
    """The sampling controls sample.py and chat.py share."""
    require(cfg.temperature >= 0, f"temperature={cfg.temperature} must be >= 0 (0 means greedy)")
    require(cfg.top_k is None or cfg.top_k >= 1, f"top_k={cfg.top_k} must be at least 1, or None")
    require(0 < cfg.top_p <= 1, f"top_p={cfg.top_p} must be in (0, 1]; 1.0 turns nucleus sampling off")


def require_init_from(value, own):
    # a directory is checked for a GPT-2 or Llama inside when it is loaded (gpt/weights/load.py)
    require(
        value in own + GPT2_MODELS or os.path.isdir(value),
        f"init_from={value!r} is not one of {', '.join(map(repr, own + GPT2_MODELS))}, "
        f"nor a directory (a Hugging Face GPT-2 or Llama model, or a training run's out_dir)",
    )


ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def require_rope_scaling(scaling, pos_encoding):
    if scaling is None:
        return
    example = (
        "{'factor': 32.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192}"
    )
    require(pos_encoding == "rope", "rope_scaling scales RoPE's frequencies: it needs pos_encoding='rope'")
    require(
        sorted(scaling) == sorted(ROPE_SCALING_KEYS) and all(isinstance(v, (int, float)) for v in scaling.values()),
        f"rope_scaling={scaling!r} must have exactly the numbers {', '.join(ROPE_SCALING_KEYS)}, e.g. {example}",
    )
    require(
        scaling["factor"] >= 1
        and 0 < scaling["low_freq_factor"] < scaling["high_freq_factor"]
        and scaling["original_max_position_embeddings"] >= 1,
        f"rope_scaling={scaling!r} needs factor >= 1, 0 < low_freq_factor < high_freq_factor and "
        f"original_max_position_embeddings >= 1",
    )


def parse(cls, argv=None):
    """Build a `cls` from the defaults, the config files in argv, then its --key=value overrides."""
    argv = sys.argv[1:] if argv is None else argv
    if "--help" in argv or "-h" in argv:
        print(usage(cls))
        sys.exit(0)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    files = [a for a in argv if not a.startswith("-")]
    flags = [a for a in argv if a.startswith("-")]
    for path in files:
        for key, value in _run_config_file(path).items():
            _check_known(key, fields, where=f"in {path}")
            values[key] = _coerce(key, value, fields[key].type, source=path)
    for flag in flags:
        key, sep, text = flag.lstrip("-").partition("=")
        _check_known(key, fields, where="on the command line")
        if not sep:
            if fields[key].type is not bool:
                raise UserError(f"--{key} needs a value: write --{key}=VALUE")
            text = "True"  # a bare --flag switches a bool key on
        values[key] = _coerce(key, _literal(text), fields[key].type, source="command line", text=text)
    return cls(**values)


def override(cfg, key, text):
    """cfg with one key set from command-line text, parsed and validated as parse() does."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    _check_known(key, fields, where="to override")
    return dataclasses.replace(
        cfg, **{key: _coerce(key, _literal(text), fields[key].type, source="override", text=text)}
    )


def as_dict(cfg):
    return dataclasses.asdict(cfg)


def changed(cfg):
    """{key: value} of the keys whose value is not the dataclass's default."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != f.default}


def usage(cls):
    help_text = _field_comments(cls)
    if any(f.name not in help_text for f in dataclasses.fields(cls)):
        # the model's keys are described on GPTConfig; imported for --help only, as model.py brings torch
        from model import GPTConfig

        help_text = {**_field_comments(GPTConfig), **help_text}
    flags = {f.name: f"--{f.name}={f.default!r}" for f in dataclasses.fields(cls)}
    width = max(map(len, flags.values()))
    lines = ["keys (set in a config file or as --key=value; defaults shown):"]
    lines += [f"  {flag:<{width}}  {help_text.get(name, '')}" for name, flag in flags.items()]
    return "\n".join(lines)


def _field_comments(cls):
    # The trailing comment on each field is its documentation; read it from the source
    # so the dataclass (for the model's keys, GPTConfig) stays the one place where keys are described.
    comments = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):  # base classes' keys too
        for line in inspect.getsource(klass).splitlines():
            m = re.match(r"\s+(\w+)\s*:[^#]*#\s*(.*)$", line)
            if m:
                comments[m.group(1)] = m.group(2)
    return comments


def _run_config_file(path):
    """Execute a config file in a fresh namespace and return the keys it assigned."""
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except FileNotFoundError:
        folder, name = os.path.split(path)
        names = [n for n in os.listdir(folder or ".") if n.endswith(".py")] if os.path.isdir(folder or ".") else []
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {os.path.join(folder, close[0])}?" if close else "check the path"
        raise UserError(f"config file {path} not found; {hint}")
    except OSError as e:
        raise UserError(f"config file {path} cannot be read ({e.strerror}); check the path")
    except UnicodeDecodeError:
        raise UserError(f"config file {path} is not UTF-8 text")
    namespace = {}
    try:
        exec(compile(source, path, "exec"), namespace)
    except SyntaxError as e:
        raise UserError(f"{path}:{e.lineno}: syntax error: {e.msg}")
    except Exception as e:
        line = next((fr.lineno for fr in reversed(traceback.extract_tb(e.__traceback__)) if fr.filename == path), "?")
        raise UserError(f"{path}:{line}: {type(e).__name__}: {e}")
    # imports, functions, classes and _private names are the file's own business, not keys
    return {
        k: v
        for k, v in namespace.items()
        if not k.startswith("_") and not isinstance(v, types.ModuleType) and not callable(v)
    }


def _check_known(key, fields, where):
    if key in fields:
        return
    close = difflib.get_close_matches(key, fields, n=1)
    hint = f"did you mean {close[0]}?" if close else "see --help for the known keys"
    raise UserError(f"unknown config key '{key}' {where}; {hint}")


def _literal(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text  # a bare word such as cpu or out-shakespeare is a string


def _coerce(key, value, typ, source, text=None):
    if typing.get_origin(typ) is Literal and all(isinstance(c, str) for c in typing.get_args(typ)):
        typ = str  # a key of named choices: read as text here, refused with its choices by __post_init__
    options = typing.get_args(typ) if typing.get_origin(typ) is Union else (typ,)
    for option in options:
        ok, converted = _convert(value, option, text)
        if ok:
            return converted
    names = " or ".join(_type_name(o) for o in options)
    shown = text if text is not None else repr(value)
    raise UserError(f"{key}={shown} ({source}) is not a valid {names}")


def _type_name(typ):
    if typ is type(None):
        return "None"
    if typing.get_origin(typ) is Literal:
        return " or ".join(map(repr, typing.get_args(typ)))
    return typ.__name__


def _convert(value, typ, text):
    if typing.get_origin(typ) is Literal:  # e.g. batch_size's 'auto'
        return value in typing.get_args(typ), value
    if typ is str:
        if isinstance(value, str):
            return True, value
        # on the command line any text is a valid string: --wandb_run_name=2024, --out_dir=None
        return (True, text) if text is not None else (False, None)
    if typ is type(None):
        return value is None, None
    if typ is bool:
        if isinstance(value, bool):
            return True, value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return True, value.lower() == "true"
        return False, None
    if isinstance(value, bool):  # bool is an int subclass; True is not a batch size
        return False, None
    if typ is int:
        if isinstance(value, int):
            return True, value
        if isinstance(value, float) and value.is_integer():
            return True, int(value)  # --max_iters=5e3
        return False, None
    if typ is float:
        return isinstance(value, (int, float)), float(value) if isinstance(value, (int, float)) else None
    return isinstance(value, typ), value
