"""What a rank holds while Muon shared under DDP saves (gpt/train/muon.py's state_dict): measured on
gloo ranks, and computed for GPT-2 124M and the 1B config. A developer's tool: nothing imports it.

    python dev/muon_save_memory.py                  # torchrun on 2 and 4 gloo ranks, then the computed table
    python dev/muon_save_memory.py --matrices=16 --size=1024 --ranks=2,4

Measured: 16 matrices of 1024 x 1024 (4 MiB of fp32 momentum each) stepped once by Muon(shared=True),
then state_dict() on every rank: the bytes of the tensors in the dict it returns, and how far the
process's peak resident memory rose above its resident memory during the call (VmHWM, reset through
/proc/self/clear_refs just before). Run on an older checkout (its dev/ holding this file) for "before".

Computed, from the shapes (fp32 momenta of the blocks' 2-D weights, assign()'s owners; AdamW's two fp32
moments of every other parameter, replicated under DDP): per rank, Muon's state held, what a save
holds, before (every rank gathered every momentum: all of them copied, plus one shape's gather and
reorder buffers) and now (rank 0: every momentum, its own in place and the rest copied, plus one
matrix a rank; the others: their own, plus one matrix of padding).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpt.train import muon  # after the path line above

MB = 1e6


def vm(field):
    """/proc/self/status's field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def worker(args):
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(args.size, args.size) * 0.02) for _ in range(args.matrices)]
    opt = muon.Muon(params, shared=True, lr=0.02, momentum=0.95, nesterov=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    held = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    rss = vm("VmRSS")
    state = opt.state_dict()
    peak = vm("VmHWM") - rss
    in_dict = sum(t.numel() * t.element_size() for s in state["state"].values() for t in s.values())
    report = dict(rank=dist.get_rank(), held=held, in_dict=in_dict, peak=peak)
    with open(f"{args.report}{dist.get_rank()}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def measure(args):
    print(f"measured: {args.matrices} matrices of {args.size} x {args.size}, state_dict() on gloo ranks (MB)")
    print("| ranks | rank | momenta held | in the dict it returns | peak RSS rise during state_dict |")
    print("|---|---|---|---|---|")
    for n in map(int, args.ranks.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            report = os.path.join(tmp, "rank")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
            cmd += [os.path.abspath(__file__), "--worker", f"--report={report}"]
            cmd += [f"--matrices={args.matrices}", f"--size={args.size}"]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            for r in range(n):
                with open(f"{report}{r}.json") as f:
                    x = json.load(f)
                print(f"| {n} | {r} | {x['held'] / MB:.1f} | {x['in_dict'] / MB:.1f} | {x['peak'] / MB:.1f} |")


def shapes_of(config, vocab_size):
    """(Muon's matrices' shapes, AdamW's parameter count) of a config file's model, built on the meta device."""
    import runpy

    from gpt.train.optim import is_muon_param
    from model import GPT, GPTConfig

    values = runpy.run_path(config)
    fields = GPTConfig.__dataclass_fields__
    with torch.device("meta"):
        model = GPT(GPTConfig(**{k: v for k, v in values.items() if k in fields}, vocab_size=vocab_size))
    named = list(model.named_parameters())
    return [tuple(p.shape) for n, p in named if is_muon_param(n, p)], sum(
        p.numel() for n, p in named if not is_muon_param(n, p)
    )


def compute():
    print("\ncomputed: per rank, MB (fp32; Muon momenta only, no NorMuon)")
    print(
        "| model | ranks | Muon held (busiest) | AdamW held | save before, every rank | save now, rank 0 | save now, others |"
    )
    print("|---|---|---|---|---|---|---|")
    models = [("GPT-2 124M", "config/train_gpt2.py", 50304), ("Llama 1B", "config/train_llama_1b.py", 128256)]
    for name, config, vocab in models:
        matrices, adamw = shapes_of(config, vocab)
        counts = {}
        for s in matrices:
            counts[s] = counts.get(s, 0) + 1
        whole = 4 * sum(a * b for a, b in matrices)
        for n in (1, 2, 4, 8):
            owners = muon.assign(counts, n)
            own = [4 * sum(a * b * o.count(r) for (a, b), o in owners.items()) for r in range(n)]
            chunk = {s: max(o.count(r) for r in range(n)) for s, o in owners.items()}
            # before, shape by shape in the model's order: own in place, the copies so far, and this shape's
            # stack, N stacks gathered, their cat and its reorder (all alive while its copies are made)
            copies, before = 0, 0
            for a, b in counts:
                copies += 4 * a * b * counts[a, b]
                before = max(before, max(own) + copies + 4 * a * b * (chunk[a, b] * (n + 1) + 2 * counts[a, b]))
            rank0 = whole + max(4 * a * b * n for a, b in counts) if n > 1 else whole
            others = max(own[1:]) + max(4 * a * b for a, b in counts) if n > 1 else 0
            if n == 1:
                before = whole
            row = [name, n, max(own), 8 * adamw, before, rank0]
            print(
                "| {} | {} | {:,.0f} | {:,.0f} | {:,.0f} | {:,.0f} | ".format(*row[:2], *(x / MB for x in row[2:]))
                + (f"{others / MB:,.0f} |" if n > 1 else "- |")
            )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--report")
    parser.add_argument("--matrices", type=int, default=16)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--ranks", default="2,4")
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        measure(args)
        compute()


if __name__ == "__main__":
    main()
