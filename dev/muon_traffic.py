"""The bytes a rank sends in one training step with Muon shared under DDP, measured on gloo ranks and
computed, for the design this trainer runs and for two it does not (docs/distributed.md, issue 66):

    ours          DDP's all-reduce of every gradient (fp32), then Muon's all-gather of each owner's
                  orthogonalized updates, one padded stack a shape (gpt/train/muon.py's _step_ddp)
    scatter       Muon's gradients reduce-scattered to their owners instead (one padded stack a shape),
                  the other gradients all-reduced, the same all-gather of updates
    zero1 AdamW   ours, with AdamW's state shared too (torch's ZeroRedundancyOptimizer: each rank steps
                  its share of AdamW's parameters and broadcasts them)

Measured: each rank's `wchar` in /proc/<pid>/io (the bytes its process passed to write calls; gloo
writes its TCP sends with them) around the backward pass and around each optimizer's step, on the
config's model at a narrower width (the sends scale with the parameters, not the batch). Computed:
the same collectives' bytes from the shapes, for a ring (what NCCL and gloo run for all-reduce and
all-gather). A developer's tool: nothing imports it.

    python dev/muon_traffic.py                        # 4 gloo ranks at n_embd=256, then GPT-2 124M computed
    python dev/muon_traffic.py --ranks=2 --n_embd=128
"""

import argparse
import json
import os
import runpy
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpt.train import muon  # after the path line above
from gpt.train.optim import is_muon_param
from model import GPT, GPTConfig

MB = 1e6


def sent():
    """The bytes this process has passed to write calls so far."""
    with open(f"/proc/{os.getpid()}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def model_of(config, vocab_size, overrides, device=None):
    values = {**runpy.run_path(config), **overrides}
    fields = GPTConfig.__dataclass_fields__
    with torch.device(device or "cpu"):
        return GPT(GPTConfig(**{k: v for k, v in values.items() if k in fields}, vocab_size=vocab_size))


def split(model):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [p for n, p in named if is_muon_param(n, p)], [p for n, p in named if not is_muon_param(n, p)]


def worker(args):
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    raw = model_of(args.config, args.vocab_size, {"n_embd": args.n_embd, "n_head": args.n_head})
    model = torch.nn.parallel.DistributedDataParallel(raw, gradient_as_bucket_view=True)
    matrices, rest = split(raw)
    opt = muon.Muon(matrices, shared=True, lr=0.02, momentum=0.95, nesterov=True)
    adamw = torch.optim.AdamW(rest, lr=1e-3)
    x = torch.randint(0, args.vocab_size, (1, 64))
    report = {}
    dist.barrier()
    before = sent()
    _, loss = model(x, x)
    loss.backward()  # DDP's all-reduce of every gradient, bucket by bucket
    report["allreduce"] = sent() - before
    dist.barrier()
    before = sent()
    opt.step()  # the updates' all-gather
    report["muon_gather"] = sent() - before
    # the scatter design's collective: each shape's gradients, stacked and padded as the gather's stacks
    # are, reduce-scattered so each owner gets its matrices' sums
    owners = muon.assign({s: c for s, c in shape_counts(matrices).items()}, n)
    dist.barrier()
    before = sent()
    for shape, params in group_by_shape(matrices).items():
        per_rank = max(owners[shape].count(r) for r in range(n))
        stack = torch.zeros((n * per_rank, *shape))
        stack[: len(params)] = torch.stack([p.grad for p in params])
        out = torch.empty((per_rank, *shape))
        dist.reduce_scatter_tensor(out, stack)
    report["scatter_rs"] = sent() - before
    dist.barrier()
    before = sent()
    flat = torch.cat([p.grad.flatten() for p in rest])
    dist.all_reduce(flat)
    report["scatter_rest_allreduce"] = sent() - before
    # AdamW shared (ZeRO-1): its step, and the state a rank holds, beside the replicated AdamW's
    adamw.step()
    report["adamw_state"] = state_bytes(adamw)
    zero = ZeroRedundancyOptimizer(rest, optimizer_class=torch.optim.AdamW, lr=1e-3)
    dist.barrier()
    before = sent()
    zero.step()
    report["zero1_step"] = sent() - before
    report["zero1_state"] = state_bytes(zero.optim)
    with open(f"{args.report}{rank}.json", "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


def state_bytes(opt):
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def group_by_shape(matrices):
    groups = {}
    for p in matrices:
        groups.setdefault(tuple(p.shape), []).append(p)
    return groups


def shape_counts(matrices):
    return {s: len(ps) for s, ps in group_by_shape(matrices).items()}


def computed(matrices, rest_numel, n, gather_bytes, rs_factor=1.0):
    """Each design's bytes a rank sends per step on n ranks of a ring; gather_bytes: the updates' element
    size; rs_factor: a reduce-scatter's sends over the ideal (n-1)/n of its input (gloo's: 2)."""
    counts = {s: len(ps) for s, ps in matrices.items()}
    owners = muon.assign(counts, n)
    numel = sum(a * b * c for (a, b), c in counts.items())
    padded = sum(a * b * n * max(o.count(r) for r in range(n)) for (a, b), o in owners.items())
    ring = (n - 1) / n
    allreduce = 2 * ring * 4 * (numel + rest_numel)
    gather = ring * gather_bytes * padded
    scatter = rs_factor * ring * 4 * padded + 2 * ring * 4 * rest_numel + gather
    return {"allreduce": allreduce, "muon_gather": gather, "ours": allreduce + gather, "scatter": scatter}


def measure(args):
    n = args.ranks
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "rank")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
        cmd += [os.path.abspath(__file__), "--worker", f"--report={report}", f"--config={args.config}"]
        cmd += [f"--n_embd={args.n_embd}", f"--n_head={args.n_head}", f"--vocab_size={args.vocab_size}"]
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        ranks = []
        for r in range(n):
            with open(f"{report}{r}.json") as f:
                ranks.append(json.load(f))
    model = model_of(args.config, args.vocab_size, {"n_embd": args.n_embd, "n_head": args.n_head}, "meta")
    matrices, rest = split(model)
    rest_numel = sum(p.numel() for p in rest)
    groups = group_by_shape(matrices)
    cpu = computed(groups, rest_numel, n, gather_bytes=4)  # a CPU gathers fp32 (muon.ns_dtype)
    gloo = computed(groups, rest_numel, n, gather_bytes=4, rs_factor=2)
    print(f"measured on {n} gloo ranks: {args.config} at n_embd={args.n_embd}, MB a rank sends in one step")
    print(
        "| rank | all-reduce (computed) | Muon gather (computed) | scatter design: RS + rest's all-reduce "
        "(computed on gloo) | ZeRO-1 AdamW step | AdamW state, replicated / ZeRO-1 |"
    )
    print("|---|---|---|---|---|---|")
    for r, x in enumerate(ranks):
        rs = x["scatter_rs"] + x["scatter_rest_allreduce"]
        rs_computed = gloo["scatter"] - gloo["muon_gather"]
        print(
            f"| {r} | {x['allreduce'] / MB:.1f} ({cpu['allreduce'] / MB:.1f}) | {x['muon_gather'] / MB:.1f} "
            f"({cpu['muon_gather'] / MB:.1f}) | {rs / MB:.1f} ({rs_computed / MB:.1f}) | {x['zero1_step'] / MB:.1f} "
            f"| {x['adamw_state'] / MB:.1f} / {x['zero1_state'] / MB:.1f} |"
        )


def table(args):
    print("\ncomputed, MB a rank sends per step on a ring (NCCL), the updates gathered in bfloat16 (a GPU's)")
    print("| model | ranks | ours: all-reduce + gather | scatter design | scatter / ours | ZeRO-1 AdamW adds |")
    print("|---|---|---|---|---|---|")
    for name, config, vocab in (("GPT-2 124M", "config/train_gpt2.py", 50304),):
        model = model_of(config, vocab, {}, "meta")
        matrices, rest = split(model)
        rest_numel = sum(p.numel() for p in rest)
        for n in (2, 4, 8):
            c = computed(group_by_shape(matrices), rest_numel, n, gather_bytes=2)
            zero1 = (n - 1) / n * 4 * rest_numel  # each owner's share of AdamW's parameters, broadcast (fp32)
            print(
                f"| {name} | {n} | {c['ours'] / MB:,.1f} | {c['scatter'] / MB:,.1f} | "
                f"{c['scatter'] / c['ours']:.2f}x | {zero1 / MB:,.1f} |"
            )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--report")
    parser.add_argument("--config", default="config/train_gpt2.py")
    parser.add_argument("--vocab_size", type=int, default=50304)
    parser.add_argument("--n_embd", type=int, default=256)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    if args.worker:
        worker(args)
    else:
        measure(args)
        table(args)


if __name__ == "__main__":
    main()
