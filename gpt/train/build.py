"""The model as the loop trains it: the GPTConfig arguments a config asks for, and build(),
which converts its Linear layers to float8 when asked (fp8.py), adds the optimizer and GradScaler,
restores a checkpoint's state, checks the attention kernel, compiles, and wraps the model in DDP
or shards it with FSDP2 under torchrun."""

import re
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torch.nn.parallel import DistributedDataParallel as DDP

from configurator import UserError
from gpt.outdir import checkpoint
from gpt.train import fp8, optim
from model import SDPA_BACKENDS

# GPTConfig's keys that TrainConfig has: those that fix the model, and two that only start it (zero_init_proj: an init)
MODEL_KEYS = tuple(k for k in checkpoint.SHAPE_KEYS if k != "vocab_size") + ("dropout", "zero_init_proj")


def make_model_args(cfg, vocab_size):
    return {**{k: getattr(cfg, k) for k in MODEL_KEYS}, "vocab_size": vocab_size}


def build(raw_model, cfg, rt, state=None):
    """The optimizer and GradScaler for raw_model, the weights and their state restored from a
    checkpoint `state` when resuming, and the two forms the loop calls: `model` (compiled when
    asked; evaluation uses it) and `train_model` (also DDP-wrapped under torchrun). With
    parallelism='fsdp' under torchrun, raw_model itself is sharded in place instead."""
    raw_model.activation_checkpointing = cfg.activation_checkpointing
    # float8 first: FSDP2 then shards Float8Linear's weights (plain tensors, gathered in the run's
    # dtype and cast to float8 in forward), and the optimizer and a checkpoint see the same parameters
    converted, kept = fp8.convert(raw_model, cfg.fp8, cfg.fp8_skip, rt.device)
    if converted and rt.master:
        how = "emulated: float8's rounding, high-precision matmuls" if cfg.fp8 == "emulate" else "tensorwise scaling"
        print(f"fp8: {len(converted)} Linear layers in float8 ({how}); kept as they are: {', '.join(kept) or 'none'}")
    fsdp = uses_fsdp(cfg, rt)
    if fsdp:
        shard(raw_model, rt)  # before the optimizer is made: it must hold the sharded parameters
    elif cfg.parallelism == "fsdp" and rt.master:
        print("note: parallelism='fsdp' in a single process has nothing to shard over; training unsharded")
    optimizer = optim.configure(raw_model, cfg, rt.device_type)
    scaler = torch.amp.GradScaler(rt.device_type, enabled=rt.dtype == torch.float16)  # loss scaling only for fp16
    if state is not None:
        checkpoint.restore(state, raw_model, optimizer, scaler, fsdp)
    error = attention_error(raw_model.config, cfg.attention, rt.device, rt.dtype)
    if error:
        raise UserError(
            f"attention='{cfg.attention}' cannot run on {rt.device} in {str(rt.dtype).removeprefix('torch.')} "
            f"for this model ({error}); use --attention=auto"
        )
    raw_model.set_attention(cfg.attention)
    # static shapes: the training step has one shape, and eval one more (eval_group keeps it to one)
    model = torch.compile(raw_model, dynamic=False) if cfg.compile else raw_model
    # gradient_as_bucket_view: the gradients are views into DDP's all-reduce buckets, not a second
    # gradient-sized buffer copied into the buckets and back on every synced micro-step
    # (step.train_step zeroes them in place to keep them so; auto_batch.py counts one set)
    # (a replica group that averages every step gets torchft's DDP instead: torchft_groups.Groups.join)
    every_step_replicas = cfg.ft_replica_group >= 0 and not cfg.sync_every
    train_model = (
        DDP(model, device_ids=[rt.local_rank] if rt.device_type == "cuda" else None, gradient_as_bucket_view=True)
        if rt.ddp and not fsdp and not every_step_replicas
        else model
    )
    return model, train_model, optimizer, scaler


def attention_error(config, name, device, dtype):
    """None when SDPA kernel `name` runs the attention of a GPT of this config (its heads, dropout,
    GQA; forward and backward) on `device` under autocast to `dtype`; else PyTorch's reason."""
    if name == "auto":
        return None
    hs = config.n_embd // config.n_head
    device_type = torch.device(device).type
    q = torch.randn(1, config.n_head, 8, hs, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, config.n_kv_head, 8, hs, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    groups = config.n_head // config.n_kv_head
    if groups > 1 and dtype == torch.float32 and device_type != "cpu":  # as CausalSelfAttention.attend gives them
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    with warnings.catch_warnings(record=True) as caught:  # on CUDA, PyTorch warns why each kernel declined
        warnings.simplefilter("always")
        try:
            with (
                torch.random.fork_rng(devices=[device] if device_type == "cuda" else []),
                sdpa_kernel(SDPA_BACKENDS[name]),
            ):
                y = F.scaled_dot_product_attention(
                    q, k, v, dropout_p=config.dropout, is_causal=True, enable_gqa=k.size(1) != config.n_head
                )
                y.sum().backward()
        except RuntimeError as e:
            # torch warns a header ("Memory efficient kernel not used because:") and then one
            # warning per reason, each ending in "(Triggered internally at <file>:<line>.)"
            lines = [re.sub(r"\s*\(Triggered internally at .*\)$", "", str(w.message).strip()) for w in caught]
            reasons = [line for line in lines if line and not line.endswith("not used because:")]
            return "; ".join(reasons) or str(e).strip().splitlines()[0]
    return None


def uses_fsdp(cfg, rt):
    return rt.ddp and cfg.parallelism == "fsdp"


def shard(raw_model, rt):
    """FSDP2: every parameter, its gradient and its AdamW state split over the ranks. Each block
    is one unit, gathered whole just before its forward and backward and freed after; the root
    unit holds the rest (embeddings, lm_head, ln_f)."""
    # imported here: torch.distributed's FSDP and DTensor modules take ~1 s to import
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    for t in raw_model.state_dict().values():  # ranks init with their own seeds: take rank 0's weights, as DDP does
        dist.broadcast(t, src=0)
    mesh = init_device_mesh(rt.device_type, (rt.world_size,))
    # bf16/fp16 runs gather the weights in that dtype (half the traffic and memory) and reduce
    # the gradients in fp32; the fp32 shards are what AdamW updates. train_step's autocast stays
    # on, so norms, softmax and the loss run in fp32 as they do under DDP.
    policy = MixedPrecisionPolicy(param_dtype=rt.dtype, reduce_dtype=torch.float32)
    # FSDP warns that the root returns a view (the logits cut to the real vocabulary); harmless
    # here, since nothing modifies the logits in place
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for block in raw_model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(raw_model, mesh=mesh, mp_policy=policy)
