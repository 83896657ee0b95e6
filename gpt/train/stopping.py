"""Stop requests: SIGTERM (a scheduler's preemption notice), SIGINT (Ctrl-C) or a time limit,
read by the loop between steps and agreed on by every rank."""

import signal
import time

import torch
import torch.distributed as dist


class StopRequest:
    """SIGTERM (a scheduler's preemption notice) or SIGINT (Ctrl-C) only set a flag; the loop
    reads it between steps, writes a checkpoint and exits. A second Ctrl-C quits at once."""

    def __init__(self, max_minutes=0.0):
        self.reason, self.group = None, None
        self.deadline = time.monotonic() + 60 * max_minutes if max_minutes > 0 else None
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _handle(self, signum, frame):
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = signal.Signals(signum).name

    def check(self, rt):
        """True when this process should stop now; under DDP, when any rank should, so all agree."""
        if self.reason is None and self.deadline is not None and time.monotonic() > self.deadline:
            self.reason = "max_minutes"
        stop = self.reason is not None
        if rt.ddp:
            # every step, so the flag travels on the host: over gloo (a group of its own when NCCL
            # carries the gradients) the ranks wait for each other, never for their GPUs
            if self.group is None:
                self.group = (
                    dist.new_group(backend="gloo", timeout=rt.timeout) if rt.device_type == "cuda" else dist.group.WORLD
                )
            flag = torch.tensor(float(stop))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            stop = bool(flag.item())
        return stop

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
