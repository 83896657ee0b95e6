"""Muon's step, fused (gpt/train/muon.py: one compiled graph per shape) against the step before it (only the
Newton-Schulz iterations compiled; momentum, stack, cast, decay and update as foreach kernels), on
the speedrun config's matrices (config/speedrun_gpt2.py: 12 layers x 768, 48 matrices of 4
shapes), in one process. The two step in turns, so a busy machine slows both alike; prints each
one's median and the ratio. A developer's tool: nothing imports it.

    python dev/muon_bench.py                        # the speedrun's shapes, 20 steps each
    python dev/muon_bench.py --n_layer=2 --n_embd=64 --steps=3
    torchrun --standalone --nproc_per_node=4 dev/muon_bench.py --steps=5   # shared over 4 ranks

Under torchrun each rank runs Muon shared over the ranks beside the one-process step, in turns,
and rank 0 prints every rank's count of matrices orthogonalized, step time and Muon state bytes.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gpt.train import muon  # after the path line above


class Before(muon.Muon):
    """The step as it was before the fusion: the iterations compiled, the rest eager foreach ops."""

    @torch.no_grad()
    def step(self):
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            lr, m, decay = group["lr"], group["momentum"], 1 - group["lr"] * group["weight_decay"]
            for shape, params in self.shapes(group).items():
                grads, bufs = [p.grad for p in params], self.buffers(params)
                new_bufs = torch._foreach_lerp(bufs, grads, 1 - m)
                updates = torch._foreach_lerp(grads, new_bufs, m) if group["nesterov"] else new_bufs
                update = torch.stack([u.to(muon.ns_dtype(params[0].device)) for u in updates])
                update = self.orthogonalize(update, (group["ns_coefficients"],) * group["ns_steps"], group["eps"])
                skip = found_inf.bool()
                torch._foreach_copy_(bufs, [torch.where(skip, old, new) for old, new in zip(bufs, new_bufs)])
                update, step_decay = torch.where(skip, 0, update), torch.where(skip, 1.0, decay)
                if group["weight_decay"]:
                    torch._foreach_mul_(params, step_decay)
                ratio = muon.adjusted_lr_ratio(group["adjust_lr_fn"], shape)
                torch._foreach_add_(params, update.unbind(0), alpha=-lr * ratio)


def make(shapes, device, seed=0):
    """The weights and gradients (the same on every rank, as DDP's all-reduce leaves them)."""
    torch.manual_seed(seed)
    weights = [torch.randn(s, device=device) * 0.02 for s in shapes]
    grads = [torch.randn(s, device=device) for s in shapes]  # the same every step: the time is the same
    return weights, grads


def side(cls, weights, grads, **options):
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params, cls(params, lr=0.05, momentum=0.95, weight_decay=0.01, **options), []


def timed_steps(sides, steps, device):
    """Each side's step in turn, 3 warm-up rounds then `steps` timed: {name: [seconds]}."""
    found_inf = torch.zeros((), device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for i in range(3 + steps):
        for params, opt, times in sides.values():
            opt.found_inf = found_inf
            opt.param_groups[0]["lr"] = 0.05 * (1 - i / 100)  # a moving learning rate, as the schedule's
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            if i >= 3:
                times.append(time.perf_counter() - t0)
    return {name: times for name, (_, _, times) in sides.items()}


def gap(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a, b))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n_layer", type=int, default=12)
    parser.add_argument("--n_embd", type=int, default=768)
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each, after 3 warm-up steps")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compile", type=int, default=1)
    parser.add_argument("--json", default="", help="under torchrun: rank 0 writes every rank's numbers here")
    args = parser.parse_args(argv)
    C = args.n_embd
    shapes = [(3 * C, C), (C, C), (4 * C, C), (C, 4 * C)] * args.n_layer  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    weights, grads = make(shapes, args.device)
    if "WORLD_SIZE" in os.environ:
        return shared(args, weights, grads)
    sides = {
        "before": side(Before, weights, grads, compile=True),
        "fused": side(muon.Muon, weights, grads, compile=True),
    }
    times = timed_steps(sides, args.steps, args.device)
    before, fused = (statistics.median(t) * 1e3 for t in times.values())
    print(
        f"{len(shapes)} matrices, {args.steps} steps each, interleaved; max weight gap {gap(*(s[0] for s in sides.values())):.2e}"
    )
    print(f"before {before:.1f} ms, fused {fused:.1f} ms (medians): fused/before {fused / before:.3f}")


def shared(args, weights, grads):
    """Under torchrun (gloo on a CPU, NCCL on GPUs): Muon shared over the ranks against the one-process
    step in each rank, in turns; each rank's count of matrices orthogonalized per step, its median step
    time, its Muon state bytes, and its weights' largest gap to the one-process step's."""
    dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sides = {
        "shared": side(muon.Muon, weights, grads, compile=bool(args.compile), shared=True),
        "alone": side(muon.Muon, weights, grads, compile=bool(args.compile)),
    }
    counted = []
    opt = sides["shared"][1]
    direction = opt.direction
    opt.direction = lambda *a: counted.append(len(a[0])) or direction(*a)  # a's first: the owned gradients
    times = timed_steps(sides, args.steps, args.device)
    state_bytes = lambda o: sum(t.numel() * t.element_size() for s in o.state.values() for t in s.values())
    mine = {
        "rank": rank,
        "orthogonalized": sum(counted) // (3 + args.steps),
        "of": len(weights),
        "shared_ms": statistics.median(times["shared"]) * 1e3,
        "alone_ms": statistics.median(times["alone"]) * 1e3,
        "state_bytes": state_bytes(opt),
        "alone_state_bytes": state_bytes(sides["alone"][1]),
        "max_gap": gap(sides["shared"][0], sides["alone"][0]),
    }
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        for r in everyone:
            print(
                f"rank {r['rank']}/{world_size}: orthogonalizes {r['orthogonalized']} of {r['of']} matrices, "
                f"{r['shared_ms']:.1f} ms a step (one process: {r['alone_ms']:.1f} ms), Muon state "
                f"{r['state_bytes'] / 2**20:.2f} MiB of {r['alone_state_bytes'] / 2**20:.2f}, "
                f"weights within {r['max_gap']:.1e} of one process's"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(everyone, f)
    dist.barrier()  # no rank tears gloo down while rank 0 still writes: a peer gone mid-teardown aborted it once
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
