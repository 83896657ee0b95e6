"""One rank of a torchrun test of Muon shared over the ranks (tests/test_muon_dist.py): bare matrices
stepped with Muon(shared=True) and, beside them, a copy with the one-process Muon on the same
gradients; then a fresh Muon resumed from the shared one's state through DCP's get_state_dict and
set_state_dict, as the sharded checkpoint format does, and all three stepped once more.

    torchrun --standalone --nproc_per_node=4 tests/muon_rank.py REPORT OPTIONS

OPTIONS, JSON: shapes ([[A, B, count], ...]), steps, backend (torch.compile's for compile=True; null:
eager). The rank writes REPORT<rank>.json: matrices orthogonalized each step, momenta held, state
bytes (held, and in the state_dict it returns), the largest weight gaps to the one-process Muon,
and torch.compile's unique graphs."""

import copy
import functools
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def matrices(shapes):
    """A module of bare matrices, the same on every rank (named as DCP names parameters)."""
    torch.manual_seed(0)
    weights = [torch.randn(a, b) * 0.1 for a, b, count in shapes for _ in range(count)]
    return torch.nn.ParameterList(weights)


def step(model, opt, seed):
    """One step on gradients drawn from `seed`, with found_inf as gpt.train.step.train_step sets it."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.grad_scale, opt.found_inf = None, torch.zeros(())
    opt.step()
    del opt.grad_scale, opt.found_inf
    opt.zero_grad(set_to_none=False)  # as under DDP


def gap(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def state_bytes(state):
    """The bytes of the tensors in an optimizer's state ({param or index: {key: tensor}})."""
    return sum(t.numel() * t.element_size() for s in state.values() for t in s.values())


def main(report, options):
    from torch._dynamo.utils import counters
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from gpt.outdir.checkpoint import each_rank_its_own
    from gpt.train.muon import Muon

    if options.get("backend"):
        torch.compile = functools.partial(torch.compile, backend=options["backend"])
    dist.init_process_group("gloo")
    hyper = dict(compile=bool(options.get("backend")), lr=0.02, momentum=0.95, weight_decay=0.01, nesterov=True)
    shared, alone = matrices(options["shapes"]), matrices(options["shapes"])
    opt, opt_alone = Muon(shared.parameters(), shared=True, **hyper), Muon(alone.parameters(), **hyper)
    orthogonalized = []
    direction = opt.direction

    def counting_direction(grads, *args):
        orthogonalized[-1] += len(grads)
        return direction(grads, *args)

    opt.direction = counting_direction
    for i in range(options["steps"]):
        orthogonalized.append(0)
        step(shared, opt, i)
        step(alone, opt_alone, i)
    out = dict(orthogonalized=orthogonalized, gap=gap(shared, alone), graphs=counters["stats"]["unique_graphs"])
    out.update(momenta=sum("momentum_buffer" in s for s in opt.state.values()), of=len(list(shared.parameters())))
    out.update(state_bytes=state_bytes(opt.state), alone_state_bytes=state_bytes(opt_alone.state))
    out.update(state_dict_bytes=state_bytes(opt.state_dict()["state"]))  # the full format's: whole on rank 0

    with each_rank_its_own(opt):  # what a sharded checkpoint writes: each rank its own, copied as to a file
        weights, optim = copy.deepcopy(get_state_dict(shared, opt))
    resumed = matrices(options["shapes"])
    opt_resumed = Muon(resumed.parameters(), shared=True, **hyper)
    with each_rank_its_own(opt_resumed):
        get_state_dict(resumed, opt_resumed)  # the resume: DCP's zero step on empty state, as in set_state_dict
        set_state_dict(resumed, opt_resumed, model_state_dict=weights, optim_state_dict=optim)
    orthogonalized.append(0)
    for model, o in ((shared, opt), (alone, opt_alone), (resumed, opt_resumed)):
        step(model, o, options["steps"])
    out.update(resumed_gap=gap(resumed, shared), alone_gap=gap(shared, alone))
    out.update(graphs_resumed=counters["stats"]["unique_graphs"])
    with open(f"{report}{dist.get_rank()}.json", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
