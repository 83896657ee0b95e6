"""Muon for the blocks' weight matrices: torch.optim.Muon's update, one compiled step per shape,
its work shared out across the ranks under torchrun.

Muon (torch.optim.Muon) replaces each matrix's momentum by the nearest semi-orthogonal matrix
(five Newton-Schulz iterations) before stepping, so every direction of the update moves by about
the same amount. The matrices of one shape are stacked (k, A, B) and orthogonalized together
(modded-nanogpt does the same): three batched matmuls per iteration and shape where torch's loop
runs three per matrix.

One step of one shape is three pieces, each a pure function of tensors:
  momentum       the momenta lerped toward the gradients, Nesterov's look-ahead, the cast, the stack
  orthogonalize  the Newton-Schulz iterations on the stack (and NorMuon's normalization, a lever)
  apply          decay (cautious, a lever), and the update scaled by the learning rate, into the weights
In one process they run as one function, which compile=True compiles into one graph per shape.
The learning rate and momentum enter it as 0-D CPU tensors (filled from the schedule each step),
so a moving learning rate never recompiles, and train_step's found_inf (a device tensor) decides
a skipped step inside it, with no host sync: where it is 1 weights and momenta stay bit-unchanged.

Under torchrun the pieces are split by collectives (docs/distributed.md says why this way):
- DDP (shared=True, plain parameters): the gradients arrive all-reduced, as DDP leaves them. The
  matrices of every shape are shared out by assign(), so each rank's Newton-Schulz FLOPs are about
  1/N of them all (not just k/N of each shape's k, which gives the same ranks every shape's larger
  share); a rank keeps momenta for its own only, runs momentum and orthogonalize on them, and
  all-gathers the orthogonalized updates, which every rank then applies to every matrix (the same
  numbers on every rank, so the replicas stay equal bit for bit). state_dict gathers the momenta to
  rank 0 only, matrix by matrix, so the full checkpoint it writes holds the whole state (the sharded
  format gathers nothing: each rank writes its own); load_state_dict keeps this rank's, dropping the
  rest before torch's copies them, so a resume on another world size shares them out anew.
- FSDP2 (the parameters are DTensors, Shard(0)): momentum is elementwise, so it runs on each
  rank's rows, with the momenta sharded as the weights are (as AdamW's state is: DCP checkpoints
  and reshards them as it does AdamW's). An all-to-all sends each matrix's rows to its owner, who
  orthogonalizes the whole matrix; a second all-to-all sends the rows of the result back.

torch's Muon runs the iterations in bfloat16, the right call on a GPU's tensor cores. A CPU
without bfloat16 matmul units (no AVX512-BF16 or AMX) emulates them: on a 2-core AVX2 EPYC the
quick start's 8 small matrices took 440 ms a step in bfloat16 against 7 ms in float32. So on a CPU
Muon here orthogonalizes in float32 (CPU_NS_DTYPE), elsewhere in bfloat16 as torch does.
"""

import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from configurator import UserError

CPU_NS_DTYPE = torch.float32  # the Newton-Schulz iterations' dtype on a CPU (torch's own: bfloat16)


def ns_dtype(device):
    """The dtype Muon orthogonalizes in on `device`: bfloat16 as torch's Muon, float32 on a CPU."""
    return CPU_NS_DTYPE if device.type == "cpu" else torch.bfloat16


# Polar Express (Amsel et al. 2025, arXiv:2505.16932): a quintic per iteration, each the minimax
# best for the interval of singular values the previous ones leave, with the input scaled by 1.02
# for safety. The published five-step schedule, as modded-nanogpt and nanochat run it.
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
POLAR_EXPRESS_SAFETY = 1.02
NORMUON_BETA2 = 0.95  # NorMuon's second-moment decay (Li et al. 2025, arXiv:2510.05491), nanochat's value


class Iteration(NamedTuple):
    """What a step of one group does beyond its numbers: fixed for a run, so compiled as constants."""

    nesterov: bool
    dtype: torch.dtype  # the Newton-Schulz iterations'
    schedule: tuple  # one (a, b, c) per iteration
    eps: float
    safety: float  # the input's norm is scaled by this before the iterations
    decay: bool  # weight_decay > 0
    normuon: bool  # NorMuon's per-neuron normalization after the iterations
    cautious: bool  # decay only where the update and the weight agree in sign


def orthogonalize(m, schedule, eps, safety=1.0):
    """torch's Newton-Schulz iteration (torch.optim._muon) on a stack of matrices, in m's dtype:
    m (k, A, B) -> about U V^T of each matrix's SVD, each singular value pushed toward 1 by a
    quintic a x + b x^3 + c x^5 per iteration, one (a, b, c) of `schedule` each (torch's: the same
    five times). baddbmm is torch's addmm batched: the same rounding."""
    wide = m.size(-2) > m.size(-1)
    x = m.mT if wide else m  # iterate on the (short, long) side: the Gram matrices are the smaller ones
    norm = x.norm(dim=(-2, -1), keepdim=True)  # each: spectral norm <= Frobenius norm
    x = x / (norm * safety if safety != 1.0 else norm).clamp(min=eps)
    for a, b, c in schedule:
        gram = x @ x.mT  # (k, A, A)
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if wide else x


def normalize_neurons(o, seconds, found_inf):
    """NorMuon: each neuron's row (the long side's: one number per row of a tall matrix, per
    column of a wide one) divided by the root of a running mean of its squared update, then the
    matrix scaled back to its norm, so the step's size stays Muon's and only its spread across
    neurons evens out. o (k, A, B); seconds: the k running means, (A, 1) or (1, B), float32,
    updated in place, or kept where found_inf is 1."""
    dim = -1 if o.size(-2) >= o.size(-1) else -2
    x = o.float()
    v = torch.stack(seconds)
    new = torch.lerp(v, x.square().mean(dim=dim, keepdim=True), 1 - NORMUON_BETA2)
    for s, n in zip(seconds, new.unbind(0)):
        s.copy_(n if found_inf is None else torch.where(found_inf.bool(), s, n))
    y = x * new.clamp(min=1e-10).rsqrt()
    y = y * (x.norm(dim=(-2, -1), keepdim=True) / y.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-10))
    return y.to(o.dtype)


def momentum(grads, bufs, h, found_inf, grad_scale, it):
    """k gradients (of one shape, or of one rank's rows of it) -> their updates stacked (k, A, B)
    in it.dtype, Nesterov's when it.nesterov; the momenta lerped in place, or left as they were
    where found_inf is 1."""
    if grad_scale is not None:  # gradients still multiplied by fp16's loss scale
        grads = [g / grad_scale for g in grads]
    new = [torch.lerp(b, g, h["1-momentum"]) for b, g in zip(bufs, grads)]
    updates = [torch.lerp(g, b, h["momentum"]) for g, b in zip(grads, new)] if it.nesterov else new
    for b, n in zip(bufs, new):
        b.copy_(n if found_inf is None else torch.where(found_inf.bool(), b, n))
    return torch.stack([u.to(it.dtype) for u in updates])


def apply(params, update, h, found_inf, it):
    """Decay each of the k weights, then add update (k, A, B) times -lr * torch's shape scale; a
    skipped step (found_inf 1) decays by 1 and adds a zero update (alpha < 0 adds -0.0: every
    weight bit for bit)."""
    decay, scale = h.get("decay"), h["-lr*ratio"]
    if found_inf is not None:
        skip = found_inf.bool()
        update = torch.where(skip, 0, update)
        decay = torch.where(skip, 1.0, decay) if it.decay else None
    for p, u in zip(params, update.unbind(0)):
        if it.decay and it.cautious:  # the step moves p by -u: decay where that moves it toward 0 anyway
            p.mul_(torch.where(u * p > 0, decay, 1.0))
        elif it.decay:
            p.mul_(decay)
        if isinstance(scale, float):
            p.add_(u, alpha=scale)  # torch's own op, one rounding: eager steps as torch's Muon, bit for bit
        else:  # compiled: the scale is a tensor, which alpha cannot take; inductor fuses the product
            p.add_(u.to(p.dtype) * scale)


def direction(grads, bufs, seconds, h, found_inf, grad_scale, it):
    """Momentum, the iterations and NorMuon's normalization: the orthogonalized updates (k, A, B)."""
    o = orthogonalize(momentum(grads, bufs, h, found_inf, grad_scale, it), it.schedule, it.eps, it.safety)
    return normalize_neurons(o, seconds, found_inf) if it.normuon else o


def fused_step(params, grads, bufs, seconds, h, found_inf, grad_scale, it):
    """The whole step of one shape in one process: one graph when compiled."""
    apply(params, direction(grads, bufs, seconds, h, found_inf, grad_scale, it), h, found_inf, it)


def adjusted_lr_ratio(adjust_lr_fn, shape):
    """torch's Muon learning-rate scale for an (A, B) matrix: 'original' (the default) sqrt(max(1, A/B)),
    'match_rms_adamw' 0.2 sqrt(max(A, B)), so the update's RMS matches AdamW's."""
    A, B = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1, A / B))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(A, B))
    return 1.0


def ns_flops(shape, steps=5):
    """The Newton-Schulz iterations' FLOPs on one (A, B) matrix, s and l its short and long sides: per
    iteration the Gram matrix (s, s), its square, and that times x (s, l): 4 s^2 l + 2 s^3."""
    short, long = sorted(shape[:2])
    return steps * (4 * short * short * long + 2 * short**3)


def assign(counts, world_size):
    """{shape: [the rank that orthogonalizes each of its matrices, in order]} for counts {shape: how
    many matrices}: the matrices taken largest first (ns_flops), each to the rank with the fewest
    FLOPs so far; a tie to the rank holding fewest of that shape (less padding in the collectives),
    then the lowest. The busiest rank's FLOPs are within 1.1x of 1/N of them all for GPT-2 124M and
    the 1B at 2 to 16 ranks (tests/test_muon_balance.py). A pure function of the shapes, their counts
    and the world size: every rank, and every resume on any world size, computes the same."""
    load, owners = [0] * world_size, {}
    for shape in sorted(counts, key=ns_flops, reverse=True):  # stable: equal shapes in counts' order
        held, owners[shape] = [0] * world_size, []
        for _ in range(counts[shape]):
            r = min(range(world_size), key=lambda r: (load[r], held[r], r))
            owners[shape].append(r)
            load[r] += ns_flops(shape)
            held[r] += 1
    return {shape: owners[shape] for shape in counts}


def by_rank(owners, world_size):
    """[the indices of the matrices rank r owns, in order, for each rank r] from assign()'s owners of one shape."""
    return [[i for i, o in enumerate(owners) if o == r] for r in range(world_size)]


def in_order(pieces, mine):
    """Each rank's rows (pieces[r][:len(mine[r])], mine as by_rank's) in the matrices' order: (k, ...)."""
    stacked = torch.cat([piece[: len(m)] for piece, m in zip(pieces, mine)])
    order = [i for m in mine for i in m]
    return stacked[sorted(range(len(order)), key=order.__getitem__)]


class Muon(torch.optim.Muon):
    """torch.optim.Muon's update, one step per shape (compiled with compile=True), in bfloat16,
    or float32 on a CPU. The same hyperparameters, state (momentum_buffer) and learning-rate
    scaling as torch's, so checkpoints move between them and between devices. Like fused AdamW it
    takes GradScaler's protocol (grad_scale, found_inf set before step).

    shared=True under torchrun: each rank orthogonalizes its share of each shape's matrices (the
    module docstring); with DTensor parameters (FSDP2) the rows of each matrix go to its owner."""

    _step_supports_amp_scaling = True

    def __init__(
        self, params, compile=False, shared=False, polar_express=False, normuon=False, cautious=False, **kwargs
    ):
        super().__init__(params, **kwargs)
        # nanochat's levers (configurator.py's muon_polar_express, muon_normuon, muon_cautious_wd):
        # this run's choice, like compile, so not in param_groups, which a checkpoint would bring back
        self.polar_express, self.normuon, self.cautious = polar_express, normuon, cautious
        self.rank, self.world_size = (dist.get_rank(), dist.get_world_size()) if shared else (0, 1)
        self.fsdp = shared and any(_is_dtensor(p) for g in self.param_groups for p in g["params"])
        if self.fsdp and normuon:
            raise UserError(
                "muon_normuon=True keeps a second moment per neuron of each whole matrix, which "
                "parallelism='fsdp' has only row shards of; use parallelism='ddp' or muon_normuon=False"
            )
        if self.fsdp:
            for g in self.param_groups:
                for p in g["params"]:
                    if p.shape[0] % self.world_size:
                        raise UserError(
                            f"optimizer='muon' under parallelism='fsdp' sends each matrix's rows to one rank, so "
                            f"the {self.world_size} ranks must divide every matrix's rows: {tuple(p.shape)} has "
                            f"{p.shape[0]}; run on a world size that divides them, or use parallelism='ddp'"
                        )
        self.sharded = shared and self.world_size > 1 and not self.fsdp  # DDP: momenta of own matrices only
        self.whole_state_dict = True  # state_dict gathers to rank 0 (the full format); the sharded format's doesn't
        self.compile = compile
        # dynamic=False: one graph per shape (four for a GPT's blocks), each its own static kernels
        wrap = (lambda f: torch.compile(f, dynamic=False, fullgraph=True)) if compile else (lambda f: f)
        self.fused_step, self.direction, self.momentum, self.orthogonalize, self.apply = map(
            wrap, (fused_step, direction, momentum, orthogonalize, apply)
        )

    def shapes(self, group):
        """{shape: the group's matrices of that shape, in order}."""
        by_shape = {}
        for p in group["params"]:
            by_shape.setdefault(tuple(p.shape), []).append(p)
        return by_shape

    def shared_out(self, group):
        """{shape: (the group's matrices of that shape, by_rank's indices of those each rank owns)}."""
        by_shape = self.shapes(group)
        owners = assign({shape: len(params) for shape, params in by_shape.items()}, self.world_size)
        return {shape: (params, by_rank(owners[shape], self.world_size)) for shape, params in by_shape.items()}

    def hyper(self, group, shape):
        """The step's numbers: Python floats in eager (torch's own arithmetic, bit for bit), 0-D
        float32 CPU tensors when compiled (inputs, so no value is compiled in; on the host, so
        filling them queues nothing on the device). Derived in float64, as torch's Muon does."""
        lr, m = group["lr"], group["momentum"]
        h = {"momentum": m, "1-momentum": 1 - m, "-lr*ratio": -lr * adjusted_lr_ratio(group["adjust_lr_fn"], shape)}
        if group["weight_decay"]:
            h["decay"] = 1 - lr * group["weight_decay"]
        return {k: torch.tensor(v, dtype=torch.float32) for k, v in h.items()} if self.compile else h

    def iteration(self, group, device):
        schedule = POLAR_EXPRESS if self.polar_express else (tuple(group["ns_coefficients"]),) * group["ns_steps"]
        return Iteration(
            nesterov=group["nesterov"],
            dtype=ns_dtype(device),
            schedule=schedule,
            eps=group["eps"],
            safety=POLAR_EXPRESS_SAFETY if self.polar_express else 1.0,
            decay=bool(group["weight_decay"]),
            normuon=self.normuon,
            cautious=self.cautious,
        )

    def buffers(self, params):
        """The momenta of `params`, zero on first use (each shaped as its weight: under FSDP2 a DTensor)."""
        for p in params:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return [self.state[p]["momentum_buffer"] for p in params]

    def seconds(self, params):
        """NorMuon's running means of `params`' squared updates per neuron, (A, 1) or (1, B), float32;
        an empty list without NorMuon."""
        if not self.normuon:
            return []
        for p in params:
            if "second_moment" not in self.state[p]:
                self.state[p]["second_moment"] = torch.zeros(state_shape("second_moment", p), device=p.device)
        return [self.state[p]["second_moment"] for p in params]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is None and self.compile:
            # a step without train_step's found_inf (DCP's zero step, which a sharded checkpoint's save
            # and load take on an empty state) gets a 0 in its place: the graph of every training step,
            # not a second one per shape (a fifth shape would pass dynamo's limit of 8 under fullgraph)
            found_inf = torch.zeros((), device=self.param_groups[0]["params"][0].device)
        scaling = found_inf, getattr(self, "grad_scale", None)
        for group in self.param_groups:
            by_shape = self.shapes(group)
            if not self.sharded and not self.fsdp:
                for shape, params in by_shape.items():
                    params = [p for p in params if p.grad is not None]
                    if params:
                        it, h = self.iteration(group, params[0].device), self.hyper(group, shape)
                        grads, bufs = [p.grad for p in params], self.buffers(params)
                        self.fused_step(params, grads, bufs, self.seconds(params), h, *scaling, it)
            elif self.sharded:
                self._step_ddp(group, scaling)
            else:
                self._step_fsdp(group, scaling)
        return loss

    def _step_ddp(self, group, scaling):
        """Each rank its own run of each shape's matrices; the orthogonalized updates all-gathered
        (asynchronously: the next shape's work overlaps this one's gather), then applied everywhere."""
        pending = []
        for shape, (params, mine) in self.shared_out(group).items():
            _check_grads(params)
            # an entry for every matrix, empty for another rank's: self.state is then empty on every
            # rank or on none, whatever a rank owns. DCP's get_state_dict and set_state_dict (the
            # sharded checkpoint format) take a zero step on an optimizer whose state is empty, and
            # this step is a collective, which a rank owning no matrix would otherwise enter alone
            for p in params:
                self.state.setdefault(p, {})
            it, h = self.iteration(group, params[0].device), self.hyper(group, shape)
            own = [params[i] for i in mine[self.rank]]
            update = torch.zeros((max(map(len, mine)), *shape), dtype=it.dtype, device=params[0].device)
            if own:
                grads, bufs = [p.grad for p in own], self.buffers(own)
                update[: len(own)] = self.direction(grads, bufs, self.seconds(own), h, *scaling, it)
            gathered = [torch.empty_like(update) for _ in range(self.world_size)]
            pending.append((params, mine, gathered, h, it, dist.all_gather(gathered, update, async_op=True)))
        for params, mine, gathered, h, it, work in pending:
            work.wait()
            self.apply(params, in_order(gathered, mine), h, scaling[0], it)  # (k, A, B)

    def _step_fsdp(self, group, scaling):
        """Momentum on this rank's rows; each matrix's rows all-to-all to its owner, who
        orthogonalizes it whole; the result's rows all-to-all back; applied to the rows here."""
        sent = []
        for shape, (params, mine) in self.shared_out(group).items():
            _check_grads(params)
            local = [p.to_local() for p in params]
            it, h = self.iteration(group, local[0].device), self.hyper(group, shape)
            bufs = [b.to_local() for b in self.buffers(params)]
            rows = self.momentum([p.grad.to_local() for p in params], bufs, h, *scaling, it)  # (k, A/N, B)
            send = _by_owner(rows, mine)  # (N * chunk, A/N, B): owner j's matrices in the j-th run
            recv = torch.empty_like(send)
            sent.append((local, mine, h, it, recv, dist.all_to_all_single(recv, send, async_op=True)))
        back = []
        for local, mine, h, it, recv, work in sent:
            work.wait()
            n, chunk, k = self.world_size, max(map(len, mine)), len(mine[self.rank])
            a, B = recv.shape[1:]
            whole = recv.view(n, chunk, a, B).transpose(0, 1)[:k].reshape(k, n * a, B)  # my matrices, every row
            done = torch.zeros((chunk, n * a, B), dtype=recv.dtype, device=recv.device)
            if k:  # not the padding
                done[:k] = self.orthogonalize(whole, it.schedule, it.eps, it.safety)
            send = done.view(chunk, n, a, B).transpose(0, 1).contiguous()  # to rank i: its rows of each
            recv = torch.empty_like(send)
            back.append((local, mine, h, it, recv, dist.all_to_all_single(recv, send, async_op=True)))
        for local, mine, h, it, recv, work in back:
            work.wait()
            self.apply(local, in_order(recv, mine), h, scaling[0], it)  # (k, A/N, B)

    def state_dict(self):
        """torch's state_dict. Under DDP sharing a collective call (every rank makes it, as
        checkpoint.make_checkpoint does): rank 0, the full format's writer, gathers in the other
        ranks' momenta (and NorMuon's second moments), one matrix a rank at a time, into host memory,
        so its dict is whole; every other rank's holds its own matrices' state and an empty entry for
        each other matrix, as its self.state does. With whole_state_dict False (checkpoint.py's
        sharded format, where DCP writes each rank's keys) nothing is gathered: every rank's is its own."""
        state = super().state_dict()
        if not self.sharded or not self.whole_state_dict or not self.state:
            return state
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state["state"] = {i: dict(s) for i, s in state["state"].items()}  # filled below: self.state's left as it is
        keys = ("momentum_buffer", "second_moment") if self.normuon else ("momentum_buffer",)
        for group in self.param_groups:
            for params, mine in self.shared_out(group).values():
                own = [params[i] for i in mine[self.rank]]
                for key, tensors in zip(keys, (self.buffers(own), self.seconds(own))):
                    for p, t in zip(own, tensors):
                        state["state"].setdefault(index[p], {})[key] = t
                    for p, t in self._gather_to_writer(params, mine, key, tensors):
                        state["state"].setdefault(index[p], {})[key] = t
        return state

    def _gather_to_writer(self, params, mine, key, tensors):
        """(matrix, its state `key`) for each matrix of one shape that another rank owns, on rank 0,
        which holds it in host memory; nothing elsewhere. tensors: this rank's own matrices' `key`.
        Gathered slot by slot (each rank's i-th matrix of the shape), so beyond the state it returns
        rank 0 holds one matrix per rank at a time (gloo's gather adds a flat copy of them), the others
        at most one of zeros, sent where a rank has no i-th and dropped here."""
        writer, shape = self.rank == 0, state_shape(key, params[0])
        dtype = params[0].dtype if key == "momentum_buffer" else torch.float32
        for slot in range(max(map(len, mine))):
            if slot < len(tensors):
                send = tensors[slot].contiguous()
            else:
                send = torch.zeros(shape, dtype=dtype, device=params[0].device)
            held = [torch.empty_like(send) for _ in range(self.world_size)] if writer else None
            dist.gather(send, held, dst=0)
            for r in range(1, self.world_size) if writer else ():
                if slot < len(mine[r]):
                    yield params[mine[r][slot]], held[r].cpu()

    def load_state_dict(self, state_dict):
        """torch's. Under DDP sharing the other ranks' matrices' entries are dropped from
        state_dict first, so they are never cast or copied here (nor read from disk where the full
        checkpoint is memory-mapped: checkpoint.load_newest), and each is left an empty entry, as
        _step_ddp leaves them; a resume on another world size shares the matrices out anew."""
        if not self.sharded:
            return super().load_state_dict(state_dict)
        # saved ids (ints, or DCP's names) in param_groups order are this optimizer's parameters, as torch maps them
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        mine = set()
        for group in self.param_groups:
            for params, owned in self.shared_out(group).values():
                mine.update(params[i] for i in owned[self.rank])
        ours = [i for i, p in zip(saved, (p for g in self.param_groups for p in g["params"])) if p in mine]
        had_state = bool(state_dict["state"])
        super().load_state_dict(
            {**state_dict, "state": {i: state_dict["state"][i] for i in ours if i in state_dict["state"]}}
        )
        if had_state:  # an entry for every matrix, as _step_ddp makes: self.state empty on every rank or on none
            for group in self.param_groups:
                for p in group["params"]:
                    self.state.setdefault(p, {})


def state_shape(key, p):
    """The shape of a matrix p's state `key` (float32, as the weights Muon steps are): the momentum
    its own, NorMuon's second moment one number per neuron of the long side."""
    A, B = p.shape
    if key == "momentum_buffer":
        return (A, B)
    return (A, 1) if A >= B else (1, B)


def _is_dtensor(t):
    return hasattr(t, "to_local") and hasattr(t, "placements")


def _check_grads(params):
    # a shared step is a collective: every rank must send every matrix, so none may lack a gradient
    if any(p.grad is None for p in params):
        raise RuntimeError("Muon shared over ranks needs a gradient for every matrix (a collective step)")


def _by_owner(rows, mine):
    """rows (k, a, B) -> (N * chunk, a, B): owner j's matrices (mine[j], by_rank's) at [j chunk, j chunk +
    len(mine[j])), zeros after."""
    chunk = max(map(len, mine))
    out = rows.new_zeros((len(mine) * chunk, *rows.shape[1:]))
    for j, m in enumerate(mine):
        out[j * chunk : j * chunk + len(m)] = rows[m]
    return out
