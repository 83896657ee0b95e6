"""Fault-tolerant replica groups (torchft): R copies of the run, each one process or a torchrun
job (DDP inside), that average their gradients every step through torchft's Manager. A group
that dies costs the others one failed step; they go on without it, and when it comes back it
copies the live weights, optimizer state, data position and step from a peer (healing) instead
of reading a checkpoint.

    torchft_lighthouse --min_replicas=1 --join_timeout_ms=10000 &
    TORCHFT_LIGHTHOUSE=http://localhost:29510 python train.py ... --ft_replica_group=0 --ft_groups=2 --init_from=auto
    TORCHFT_LIGHTHOUSE=http://localhost:29510 python train.py ... --ft_replica_group=1 --ft_groups=2 --init_from=auto

A group of W ranks is started with torchrun --nproc_per_node=W train.py ... --ft_replica_group=g.
Its rank r averages the gradients with its own group's ranks (torchrun's process group), then
with rank r of every other group (torchft's), so each step averages them over all R x W ranks as
one R x W-rank DDP job would; healing, rank r copies rank r of a live group.

train.py holds a Groups as gpt/train/replicas.py describes (replicas.of(cfg) makes it): join wraps the
model in torchft's DistributedDataParallel and the optimizer in its OptimizerWrapper and starts
the first quorum; step_done gives the step count after a step: the Manager's, which jumps
forward when this group healed.

With sync_every=H > 0 the groups do not average gradients: each steps its own optimizer, and
every H steps torchft's DiLoCo (an outer SGD step, Nesterov momentum, on the averaged change of
the weights since the last sync) or LocalSGD (the weights averaged) syncs them over the Manager.
The outer state (DiLoCo's outer optimizer and the weights of the last sync) goes into the
checkpoint (outer_state), so a resume between syncs continues exactly.
"""

import concurrent.futures
import copy
import os
import re
import socket
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import TCPStore

from configurator import UserError
from gpt.train import optim

try:
    from torchft.ddp import DistributedDataParallel
    from torchft.local_sgd import DiLoCo, LocalSGD
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupBabyNCCL, ProcessGroupGloo
except ImportError:  # torchft has wheels for Linux x86-64 only: elsewhere train.py runs, and replica groups are refused
    DistributedDataParallel = OptimizerWrapper = object
    Manager = DiLoCo = LocalSGD = None


def process_group(device_type, timeout):
    """torchft's reconfigurable process group between the groups: NCCL in a child process (which
    it can kill when a peer dies mid-collective) on GPUs, gloo on the CPU."""
    return ProcessGroupBabyNCCL(timeout=timeout) if device_type == "cuda" else ProcessGroupGloo(timeout=timeout)


class _Manager(Manager or object):
    """torchft's Manager, counting the bytes this group all-reduces (sent): the gradients of an
    every-step run, the weights or pseudo-gradients of a sync; and a quorum that never came (the
    lighthouse is gone, or fewer than ft_min_groups groups are up) in one line, not a traceback."""

    sent = 0

    def allreduce(self, tensor, *args, **kwargs):
        self.sent += tensor.nbytes
        return super().allreduce(tensor, *args, **kwargs)

    def wait_quorum(self):
        try:
            super().wait_quorum()
        except (TimeoutError, RuntimeError) as e:  # torchft's client: a deadline, or another gRPC status
            found = re.search(r'message: "([^"]*)"', str(e))  # a gRPC status: its message alone
            reason = found.group(1) if found else (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise UserError(
                f"no quorum from the torchft lighthouse at {self.lighthouse} within dist_timeout_s="
                f"{self._quorum_timeout.total_seconds():g}: is it running, with at least ft_min_groups="
                f"{self._min_replica_size} group(s) up? Restart it, then the groups with --init_from=auto "
                f"(each resumes from its newest checkpoint) [{reason}]"
            ) from None


class _DDP(DistributedDataParallel):
    """torchft's DistributedDataParallel (gradients averaged over the groups in the quorum by the
    Manager), averaged first over the group's own ranks when it is a torchrun job, with a
    communication hook that survives a failed all-reduce: torchft 0.2's asserts on the
    placeholder the Manager returns once a peer died. The bucket is then left as it is; the step
    does not commit, so its gradients are never used."""

    @staticmethod
    def _comm_hook(manager, bucket):
        buffer = bucket.buffer()
        if dist.is_initialized():  # the group's own ranks; one that dies takes its group down, and torchrun restarts it
            dist.all_reduce(buffer)
            buffer /= dist.get_world_size()
        manager.allreduce(buffer).wait()  # in place: summed over the groups, divided by the participants
        done = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done


class _Optimizer(OptimizerWrapper):
    """torchft's OptimizerWrapper (zero_grad starts the next quorum, step steps only when every
    group's Manager agreed to commit), which also keeps the data position of the step committed
    last for a healing peer, and sets the learning rate of the step this group healed to."""

    def __init__(self, manager, inner, replicas):
        super().__init__(manager, inner)
        self.replicas = replicas

    def step(self, closure=None):
        committed = self.manager.should_commit()  # a pending heal is applied in here
        self.replicas.participants = self.manager.num_participants() if committed else 0
        if committed:
            if self.replicas.healed:
                # the step's lr and Muon momentum (the commit counted the step)
                lr = optim.schedule(self.optim, self.manager.current_step() - 1, self.replicas.cfg)
                for group in self.optim.param_groups:
                    group["lr"] = lr * group.get("lr_scale", 1.0)
                self.replicas.healed = False
            self.optim.step()
        self.replicas.snapshot()

    def zero_grad(self, set_to_none=True):
        """The next step's quorum starts here, except after the run's last step: a quorum for a
        step that never comes would still be connecting the groups' process group as the
        process exits, which can abort it (std::terminate in gloo)."""
        if self.manager.current_step() < self.replicas.cfg.max_iters:
            self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)


class _Local:
    """The run's optimizer (a torch optimizer, or optim.Optimizers around several) with the step
    hooks torchft's DiLoCo and LocalSGD register: they count the steps and sync after every H-th."""

    def __init__(self, inner):
        self.optim, self.pre, self.post, self.stepped = inner, [], [], False

    @property
    def param_groups(self):
        return self.optim.param_groups

    def register_step_pre_hook(self, hook):
        self.pre.append(hook)
        return _Hook(self.pre, hook)

    def register_step_post_hook(self, hook):
        self.post.append(hook)
        return _Hook(self.post, hook)

    def step(self, closure=None):
        self._hooked(self.optim.step)
        self.stepped = True

    def count_skipped(self):
        """After each step of the loop: a step it skipped (a non-finite gradient norm, or fp16's
        GradScaler) never called step(); the hooks still count it, with no update, so every group
        syncs at the same steps."""
        if not self.stepped:
            self._hooked(lambda: None)
        self.stepped = False

    def _hooked(self, update):
        for hook in self.pre:
            hook(self, (), {})
        update()
        for hook in self.post:
            hook(self, (), {})

    def zero_grad(self, set_to_none=True):
        self.optim.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state):
        self.optim.load_state_dict(state)


class _Hook:
    def __init__(self, hooks, hook):
        self.hooks, self.hook = hooks, hook

    def remove(self):
        self.hooks.remove(self.hook)


class Groups:
    """This group in the replica groups (the object gpt/train/replicas.py describes) and what it sends a
    healing peer: weights, optimizer state, the data generator's state for the next step, and
    best_val_loss (the step is the Manager's own). Made before the out_dir is claimed; join, once
    the run is built, starts torchft's Manager."""

    def __init__(self, cfg):
        if Manager is None:
            raise UserError(
                "ft_replica_group needs torchft, which is not installed here (its wheels are for Linux x86-64): "
                "pip install torchft on such a machine, or train without --ft_replica_group"
            )
        self.cfg, self.count, self.healed, self.data_state = cfg, cfg.ft_groups, False, None
        self.participants = 0  # groups whose gradients the last step averaged (0: it did not commit)
        self.sync = self.outer = None

    def out_dir(self, cfg):
        """cfg with out_dir/group<g> as its out_dir: one writer per file, so each group checkpoints
        and logs on its own (their weights are the same at every step they share)."""
        return replace(cfg, out_dir=os.path.join(cfg.out_dir, f"group{cfg.ft_replica_group}"))

    def data_view(self, rt):
        """The Runtime the training batches are drawn with: rank r of group g (W ranks a group, R
        groups) is rank g x W + r of R x W, as DDP's rank g x W + r would be."""
        return replace(
            rt, rank=self.cfg.ft_replica_group * rt.world_size + rt.rank, world_size=self.count * rt.world_size
        )

    def join(self, run, outer=None):
        """Join the replica groups: run.train_model and run.optimizer become torchft's wrappers, and
        the first quorum is started (the wrapper's zero_grad). With sync_every, the optimizer steps
        alone and DiLoCo or LocalSGD syncs (outer: the checkpoint's outer state)."""
        cfg, rt = run.cfg, run.rt  # the run's: batch_size='auto' is a number now
        lighthouse = cfg.ft_lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not lighthouse:
            raise UserError(
                "ft_replica_group is set but no lighthouse is named: start torchft_lighthouse and pass "
                "--ft_lighthouse=http://HOST:29510 (or set TORCHFT_LIGHTHOUSE)"
            )
        # a torchrun group's ranks start from its rank 0's weights, as DDP's do (torchft's DDP broadcasts nothing)
        if rt.ddp:
            for t in run.raw_model.state_dict().values():
                dist.broadcast(t, src=0)
        self.cfg, self.run = cfg, run
        self.connect(rt, lighthouse)
        if cfg.sync_every:
            self.start_sync(cfg, outer)
            return
        run.train_model = _DDP(self.manager, run.train_model)
        run.optimizer = _Optimizer(self.manager, run.optimizer, self)
        run.optimizer.zero_grad()

    def connect(self, rt, lighthouse):
        """This group's Manager, at the lighthouse, starting from the run's step."""
        cfg, timeout = self.cfg, timedelta(seconds=self.cfg.dist_timeout_s)
        # the group's own store, on its rank 0: the Manager's and, when this group is the quorum's
        # first, the one the groups meet at to connect their process group
        self.store = TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False) if rt.master else None
        where = [socket.gethostname(), self.store.port if rt.master else 0]
        if rt.ddp:  # a torchrun group: its other ranks connect to rank 0's store
            dist.broadcast_object_list(where, src=0)
        self.sync_every, self.ranks = cfg.sync_every, rt.world_size
        self.manager = _Manager(
            pg=process_group(rt.device_type, timeout),
            load_state_dict=self.load_state_dict,
            state_dict=self.state_dict,
            min_replica_size=cfg.ft_min_groups,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=rt.rank,
            world_size=rt.world_size,
            store_addr=where[0],
            store_port=where[1],
            lighthouse_addr=lighthouse,
            replica_id=f"group{cfg.ft_replica_group}",
            init_sync=False,
            # DiLoCo needs the quorum at the sync
            use_async_quorum=not self.sync_every,
        )
        self.manager.lighthouse = lighthouse  # named in the error when no quorum comes
        # the groups start from the same seed, so their initial weights are already equal (init_sync=False);
        # the Manager counts the steps that committed: every step, or every sync
        commits = self.run.iter_num // self.sync_every if self.sync_every else self.run.iter_num
        self.manager.load_state_dict({"step": commits, "batches_committed": 0})
        self.snapshot()

    def snapshot(self):
        """The data generator's state now, between steps: what a peer healing next step takes."""
        self.data_state = dict(self.run.batches.rng.bit_generator.state)

    def state_dict(self):
        """Copies, taken at the start of the step (torchft calls this in its quorum, before this
        group's all-reduce): the peer fetches them later, while this group may already be updating
        its own weights in place. With sync_every the quorum is the sync's, after this step's
        inner update: the data position is then the next step's."""
        run = self.run
        batches = dict(run.batches.rng.bit_generator.state) if self.sync_every else self.data_state
        return copy.deepcopy(
            {
                "model": run.raw_model.state_dict(),
                "optimizer": run.optimizer.optim.state_dict(),
                "batches": batches,
                "best_val_loss": run.best_val_loss,
                "best_val_iter": run.best_val_iter,
                "iter_num": run.iter_num,
            }
        )

    def load_state_dict(self, state):
        """Healing. Every step: inside should_commit of the step the peer is at; this step commits
        the peer's averaged gradient on the peer's weights, and the next draws the peer's next
        batch. With sync_every: at the sync's quorum, where torchft's DiLoCo adds its own state
        (the outer optimizer, the weights of the last sync); this group then syncs as the peer
        does and goes on from the peer's step, whatever step it restarted from."""
        run = self.run
        run.raw_model.load_state_dict(state["model"])
        run.optimizer.optim.load_state_dict(state["optimizer"])
        run.batches.rng.bit_generator.state = state["batches"]
        if self.sync_every:
            self.healed_at = state["iter_num"]  # the peer's step: step_done goes on from it
        else:
            for _ in range(run.accum_steps):  # past this step's batches, which the peer drew already
                run.batches()
        run.best_val_loss, run.best_val_iter = state["best_val_loss"], state.get("best_val_iter")
        self.healed = True

    def step_done(self, it):
        """The step count after step `it`: one more when it committed, the peer's when this group
        healed; with sync_every, one more than this step's, or than the peer's when this group
        healed at this step's sync. The bytes sent count from here for the next step."""
        self.manager.sent = 0
        if self.sync_every:
            self.run.optimizer.count_skipped()
            if self.sync._local_step == 0:  # this step synced: the groups in its quorum
                self.participants = self.manager.num_participants()
            step = self.healed_at if self.healed else it
            self.healed = False
            return step + 1
        return self.manager.current_step()

    def log(self):
        """The step record's fields: the groups that took part in it, and the bytes this group
        all-reduced with the others in it (each of its ranks sends as many as rank 0)."""
        return {"groups": self.participants, "sync_bytes": self.manager.sent * self.ranks}

    def checkpoint(self):
        """What a checkpoint holds beside the weights and inner optimizer, with sync_every:
        DiLoCo's outer optimizer and the weights of the last sync (LocalSGD has none: None)."""
        return {"outer": self.outer_state()} if self.cfg.sync_every else {}

    def start_sync(self, cfg, outer):
        """torchft's DiLoCo or LocalSGD around the run's optimizer, at the step of the run (the
        checkpoint's outer state, from checkpoint(), when it resumed between syncs)."""
        run = self.run
        run.optimizer = _Local(run.optimizer)
        if cfg.outer_method == "diloco":
            self.outer = torch.optim.SGD(
                run.raw_model.parameters(),
                lr=cfg.outer_lr,
                momentum=cfg.outer_momentum,
                nesterov=cfg.outer_momentum > 0,
            )
            self.sync = DiLoCo(self.manager, [run.raw_model], run.optimizer, self.outer, sync_every=cfg.sync_every)
        else:
            self.sync = LocalSGD(self.manager, run.raw_model, run.optimizer, sync_every=cfg.sync_every)
        self.sync.__enter__()  # registers its step hooks on the optimizer
        self.sync._local_step = run.iter_num % cfg.sync_every  # steps since the last sync
        self.participants = cfg.ft_groups
        if outer is not None and cfg.outer_method == "diloco":
            outer = copy.deepcopy(outer)  # the checkpoint's tensors may be memory-mapped
            self.outer.load_state_dict(outer["optimizer"])
            last = self.sync._fragments[0].original_parameters  # the weights of the last sync
            for name, p in outer["last_sync"].items():
                last[name].copy_(p)

    def outer_state(self):
        """What a checkpoint holds beside the weights and inner optimizer: DiLoCo's outer
        optimizer and the weights of the last sync (LocalSGD has none)."""
        if self.outer is None:  # LocalSGD
            return None
        last = self.sync._fragments[0].original_parameters
        return {"optimizer": self.outer.state_dict(), "last_sync": {k: v.clone() for k, v in last.items()}}

    def shutdown(self):
        """Leave the groups. A quorum still in flight (the run stopped between steps) is waited
        for first, up to dist_timeout_s: its thread may be connecting the process group, and a
        process that exits under it can abort."""
        pending = self.manager._quorum_future  # torchft's Manager keeps its running quorum there
        if pending is not None:
            concurrent.futures.wait([pending], timeout=self.cfg.dist_timeout_s)
        self.manager.shutdown(wait=False)
