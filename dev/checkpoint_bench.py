"""Training time lost per checkpoint: full against sharded, synchronous against asynchronous.

    python dev/checkpoint_bench.py                                  # GPT-2 small shape (124M), CPU
    python dev/checkpoint_bench.py --n_layer=12 --n_embd=768 --reps=3 --steps=6 --out_dir=/tmp/ckpt_bench

A model and AdamW (state created by two steps) train `steps` steps from a checkpoint at the first
step boundary, and the same number without one; the difference is the time the checkpoint cost
the training (for an asynchronous save: staging, plus whatever the background write takes from
the steps running beside it; waiting for it at the end counts too). `blocked` is the time
inside save() alone. Modes are interleaved, repetition by repetition, and medians reported.
"""

import dataclasses
import os
import shutil
import statistics
import sys
import time
import types

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configurator import TrainConfig, as_dict, parse, run_main
from gpt.device import runtime
from gpt.outdir import saver
from model import GPT, GPTConfig

MODES = [("full", False), ("full", True), ("sharded", False), ("sharded", True)]


@dataclasses.dataclass
class Args:
    n_layer: int = 12  # transformer blocks
    n_embd: int = 768  # width (heads of 64)
    block_size: int = 128  # tokens per sequence
    batch_size: int = 1  # sequences per step
    steps: int = 6  # training steps per measurement: enough for a background write to finish within them
    reps: int = 3  # measurements per mode; the median is reported
    out_dir: str = "/tmp/ckpt_bench"  # where the checkpoints go (removed after each)


def main(argv=None):
    args = parse(Args, argv)
    rt = runtime.Runtime(device="cpu", device_type="cpu", dtype=torch.float32)
    torch.manual_seed(0)
    cfg = dict(
        n_layer=args.n_layer,
        n_head=args.n_embd // 64,
        n_embd=args.n_embd,
        block_size=args.block_size,
        vocab_size=50304,
        dropout=0.0,
    )
    model = GPT(GPTConfig(**cfg))
    optimizer = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), "cpu")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x = torch.randint(0, 50304, (args.batch_size, args.block_size))

    def step():
        _, loss = model(x, x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    batches = types.SimpleNamespace(rng=np.random.default_rng(0))
    info = {"model_args": cfg, "config": as_dict(TrainConfig()), "tokenizer": None, "iter_num": 1, "best_val_loss": 1.0}
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values())
    print(
        f"{model.num_params() / 1e6:.1f}M parameters, {nbytes / 1e9:.2f} GB of weights and AdamW state; "
        f"{args.steps} steps of {args.batch_size}x{args.block_size} tokens per measurement"
    )

    def run(mode):
        """(seconds for the steps, of which inside save())"""
        start, blocked = time.perf_counter(), 0.0
        writer = None
        if mode is not None:
            shutil.rmtree(args.out_dir, ignore_errors=True)
            os.makedirs(args.out_dir)
            writer = saver.Checkpointer(args.out_dir, mode[0], 1, mode[1], rt)
            writer.save(model, optimizer, scaler, False, info, batches)
            blocked = time.perf_counter() - start
        for _ in range(args.steps):
            if writer is not None:
                writer.poll()
            step()
        if writer is not None:
            writer.wait()
        return time.perf_counter() - start, blocked

    results = {m: [] for m in MODES}
    for _ in range(args.reps):
        for mode in MODES:
            base, _ = run(None)
            total, blocked = run(mode)
            results[mode].append((total - base, blocked, base))
    print(f"{'format':8s} {'async':6s} {'lost s':>7s} {'blocked s':>10s} {'steps alone s':>14s}")
    for (fmt, asynchronous), rows in results.items():
        lost, blocked, base = (statistics.median(r[i] for r in rows) for i in range(3))
        print(f"{fmt:8s} {str(asynchronous):6s} {lost:7.2f} {blocked:10.2f} {base:14.2f}")
    shutil.rmtree(args.out_dir, ignore_errors=True)


if __name__ == "__main__":
    run_main(main)
