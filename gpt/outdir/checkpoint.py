"""Checkpoints that never corrupt and scale past one host's memory, in two formats:

  full     out_dir/ckpt.pt, one file: the whole state gathered on rank 0 and written atomically.
           nanoGPT's key names, so its notebooks and scripts read ours.
  sharded  out_dir/ckpt_<iter>/, a torch.distributed.checkpoint (DCP) directory: every rank
           writes its own shards of the weights and optimizer state and its RNG states;
           checkpoint.json (iter, data position, config, scaler) is written last by rank 0 and
           marks the directory complete. DCP reshards on load, so any world size resumes it.

Either is written synchronously or in the background by gpt/outdir/saver.py, which train.py drives.
Nothing is unpickled on load: torch.load(weights_only=True), DCP's tensors and JSON.

A sharded checkpoint becomes one full file with scripts/checkpoint_convert.py.
"""

import json
import os
import re
import warnings
from contextlib import contextmanager

import torch
import torch.distributed as dist

from configurator import TrainConfig, UserError, as_dict
from gpt.data import tokenizer
from model import GPT, GPTConfig

COMMIT = "checkpoint.json"  # in a sharded directory, written last: without it the directory is incomplete


def single_process_is_meant():
    # DCP warns on every call without a process group; a single process is a supported case here
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# ---------------------------------------------------------------------------- the full format (one file)


def save(state, path):
    """Write to a temporary file beside `path`, flush it to disk, then rename over `path`.
    A crash at any point leaves either the old file or the new one, never half of one."""
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # disk full, permission, quota: the old checkpoint is still whole
        if os.path.lexists(tmp):
            os.remove(tmp)
        raise UserError(write_failed(path, e))
    _fsync_dir(path)


def write_failed(path, e):
    return (
        f"could not write checkpoint {path} ({getattr(e, 'strerror', None) or e}); the previous checkpoint is "
        f"untouched: free space or fix the permissions, then --init_from=resume"
    )


def _fsync_dir(path):
    """Make a rename (or a new file) in path's directory durable."""
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def link_or_copy(src, dst):
    """Make dst the same checkpoint as src without writing it twice (atomically)."""
    tmp = dst + ".tmp"
    if os.path.exists(tmp):
        os.remove(tmp)
    try:
        os.link(src, tmp)
    except OSError:  # filesystems without hard links
        save(load(src), dst)
        return
    os.replace(tmp, dst)


def save_rotating(state, out_dir, keep_last=1, spare=None):
    """Write `state` as out_dir/ckpt.pt, always the newest checkpoint. With keep_last > 1 (or a
    spare: a watcher follows the run) it is first written as ckpt_<iter>.pt, ckpt.pt becomes a hard
    link to it, and only then are the numbered files beyond the keep_last newest removed, but those
    spare(iters) keeps (gpt/evaluation/watch.py's Retention: not yet scored). Returns the path of ckpt.pt."""
    latest = os.path.join(out_dir, "ckpt.pt")
    if keep_last <= 1 and spare is None:
        save(state, latest)
        return latest
    numbered = os.path.join(out_dir, f"ckpt_{state['iter_num']:07d}.pt")
    save(state, numbered)
    link_or_copy(numbered, latest)
    history = _numbered(out_dir)
    # an earlier run's newer files wait for ownership.py's takeover
    doomed = [i for i in sorted(history, reverse=True)[keep_last:] if i != state["iter_num"]]
    for iter_num in set(doomed) - (spare(doomed) if spare else set()):
        os.remove(history[iter_num])
    return latest


def _numbered(out_dir, pattern=r"ckpt_(\d+)\.pt"):
    """{iter: path} of the ckpt_<iter>.pt files (or, with pattern, directories) in out_dir."""
    found = {}
    for name in os.listdir(out_dir) if os.path.isdir(out_dir) else []:
        m = re.fullmatch(pattern, name)
        if m:
            found[int(m.group(1))] = os.path.join(out_dir, name)
    return found


def load(path, map_location="cpu", mmap=False):
    """A checkpoint of either format as one dict (a sharded directory is read whole)."""
    if os.path.isdir(path):
        return read_sharded(path)
    if not os.path.isfile(path):
        raise UserError(f"no checkpoint at {path}; train one first (python train.py ...) or check --out_dir")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception:
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"  # torch.save's files are zip archives
        raise UserError(damaged(path, "cut short or corrupted" if zipped else "not a PyTorch file"))
    if not isinstance(state, dict) or "model" not in state or "model_args" not in state:
        raise UserError(damaged(path, "a PyTorch file without model/model_args inside"))
    return state


def damaged(path, what):
    return (
        f"{path} is damaged or not a checkpoint of this trainer ({what}); copy it again if it came from "
        f"elsewhere, or resume from an earlier checkpoint in its directory (keep_last)"
    )


# ---------------------------------------------------------------------------- what a checkpoint holds


def make_checkpoint(raw_model, optimizer, scaler, fsdp, info, batches, rt):
    """The full format's dict: everything needed to continue exactly. A collective call under
    DDP/FSDP (RNG states and FSDP's shards are gathered); only rank 0's is complete."""
    weights, optimizer_state = full_state(raw_model, optimizer, fsdp)
    return {
        "model": weights,  # the plain module's: no DDP or torch.compile prefixes
        "optimizer": optimizer_state,
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        **info,  # model_args, config, tokenizer, iter_num, best_val_loss, wandb_run_id
        "rng": {**gather_rng(rt), "batches": batches.state_dict()},
    }


DEVICE_RNGS = ("cuda", "mps")  # the accelerators whose generator a checkpoint carries beside the CPU's


def device_rng_state(rt):
    """This rank's accelerator generator state (a uint8 CPU tensor; 16 bytes for CUDA's Philox:
    seed and offset), or None on a CPU, whose generator is torch.get_rng_state()."""
    if rt.device_type == "cuda":
        return torch.cuda.get_rng_state(rt.device)
    if rt.device_type == "mps":
        return torch.mps.get_rng_state()
    return None


def gather_rng(rt):
    """{'torch': [each rank's CPU RNG state], and 'cuda' or 'mps': [...] on an accelerator}: each
    rank resumes its own dropout stream."""
    rng = {"torch": [torch.get_rng_state()]}
    device_rng = device_rng_state(rt)
    if device_rng is not None:
        rng[rt.device_type] = [device_rng]
    if rt.ddp:
        for key in rng:
            gathered = [None] * rt.world_size
            dist.all_gather_object(gathered, rng[key][0].cpu())
            rng[key] = gathered
    return rng


# The full format whatever the parallelism: the plain module's whole state_dict and torch's own
# optimizer state_dict (state keyed by parameter index). Under FSDP both are gathered into rank
# 0's CPU memory with torch.distributed.checkpoint's state_dict API, and on resume every rank keeps
# its own shards of the whole state. The price: rank 0 holds everything in host memory (16 bytes
# per parameter with AdamW, ~20 GB at 1.2B parameters); the sharded format never gathers.
def full_state(raw_model, optimizer, fsdp):
    """(model state_dict, optimizer state_dict), whole. Under FSDP a collective call, after
    which only rank 0's are filled; optim.Optimizers' (Muon beside AdamW) as its own state_dict
    lays it out, one state_dict per optimizer."""
    if not fsdp:
        return raw_model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(raw_model, options=options)
    by_name = [get_optimizer_state_dict(raw_model, o, options=options) for o in _each(optimizer)]
    states = [_indexed(b) if b else b for b in by_name]  # ranks other than 0 get nothing
    return weights, ({"optimizers": states} if hasattr(optimizer, "optimizers") else states[0])


def _each(optimizer):
    """The torch optimizers inside: optim.Optimizers' several, or the one."""
    return getattr(optimizer, "optimizers", [optimizer])


def _indexed(by_name):
    """An optimizer state_dict keyed by parameter name (the DCP API's) as torch's Optimizer.state_dict
    numbers them: in param_groups order."""
    index = {name: i for i, name in enumerate(name for group in by_name["param_groups"] for name in group["params"])}
    return {
        "state": {index[name]: s for name, s in by_name["state"].items()},
        "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in by_name["param_groups"]],
    }


def load_full_state(raw_model, optimizer, weights, optimizer_state, fsdp):
    """Load a whole model and optimizer state_dict; under FSDP each rank keeps its own shards."""
    if not fsdp:
        raw_model.load_state_dict(weights)
        optimizer.load_state_dict(optimizer_state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(raw_model, weights, options=options)
    names = {p: name for name, p in raw_model.named_parameters()}
    states = optimizer_state["optimizers"] if hasattr(optimizer, "optimizers") else [optimizer_state]
    for opt, state in zip(_each(optimizer), states, strict=True):
        order = [names[p] for group in opt.param_groups for p in group["params"]]  # index -> name
        by_name = {
            "state": {order[i]: s for i, s in state["state"].items()},
            "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]],
        }
        set_optimizer_state_dict(raw_model, opt, by_name, options=options)


# How an optimizer runs is this run's choice for its device, not the checkpoint writer's, which
# loading param_groups would bring: a GPU's fused=True onto MPS (whose fused kernel ignores
# found_inf), or MPS's fused=False onto a GPU (where step.py's found_inf then fails the step).
IMPLEMENTATION_KEYS = ("fused", "foreach", "capturable")


def restore(state, raw_model, optimizer, scaler, fsdp):
    """Put a checkpoint from load_newest into the model, optimizer and scaler (before compile/DDP
    wrapping, after FSDP sharding). A collective call under DDP/FSDP for a sharded one."""
    own = [{k: g[k] for k in IMPLEMENTATION_KEYS if k in g} for g in optimizer.param_groups]
    if state["format"] == "sharded":
        _load_sharded_into(state, raw_model, optimizer)
    else:
        load_full_state(raw_model, optimizer, model_state(state), state["optimizer"], fsdp)
    for group, keys in zip(optimizer.param_groups, own, strict=True):
        group.update(keys)
    if state.get("scaler") and scaler.is_enabled():
        scaler.load_state_dict(state["scaler"])


def restore_rng(state, batches, rt):
    """Each rank's dropout stream, when the world size is the checkpoint's, and the data position.
    The data order depends only on the one batch stream, so it stays exact across world sizes
    as long as the global batch does."""
    rng = state["rng"]
    if len(rng["torch"]) == rt.world_size:
        torch.set_rng_state(rng["torch"][rt.rank])
        _restore_device_rng(rng, rt)
    elif rt.master:
        print(
            f"note: checkpoint was written by {len(rng['torch'])} rank(s), this run has {rt.world_size}: dropout RNG reseeded"
        )
    batches.load_state_dict(rng["batches"])


def _restore_device_rng(rng, rt):
    """The accelerator's generator when the checkpoint was written on the same kind of device.
    Across kinds (a GPU's checkpoint resumed on a CPU, or the reverse) the saved state means
    nothing here: this device's generator keeps train.py's seed (seed + rank), and dropout
    continues on a different random stream than an unbroken run would have."""
    written = next((kind for kind in DEVICE_RNGS if kind in rng), "cpu")
    if written == rt.device_type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"][rt.rank], rt.device)
    elif written == rt.device_type == "mps":
        torch.mps.set_rng_state(rng["mps"][rt.rank])
    elif written != rt.device_type and rt.master:
        kept = (
            f"the {rt.device_type} RNG is reseeded"
            if rt.device_type in DEVICE_RNGS
            else f"its {written} RNG state is unused"
        )
        print(
            f"note: checkpoint was written on {written}, this run is on {rt.device_type}: {kept}, so dropout differs "
            f"from an unbroken run"
        )


# ---------------------------------------------------------------------------- the sharded format (a DCP directory)


def sharded_state(raw_model, optimizer, rt):
    """(tensors for DCP, optimizer param_groups for checkpoint.json). The state_dict API names
    parameters the same way whatever the wrapping, so any world size can load them; under FSDP
    the values are this rank's DTensor shards. Only tensors go to DCP: it would pickle the rest."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with each_rank_its_own(optimizer):
        weights, optim = get_state_dict(raw_model, _each(optimizer))
    rng = {f"torch_{rt.rank}": torch.get_rng_state()}  # each rank writes its own (distinct keys are not deduplicated)
    device_rng = device_rng_state(rt)
    if device_rng is not None:
        rng[f"{rt.device_type}_{rt.rank}"] = device_rng
    return {"model": weights, "optimizer": optim["state"], "rng": rng}, optim["param_groups"]


@contextmanager
def each_rank_its_own(optimizer):
    """The sharded format's optimizer state_dict: an optimizer whose state_dict gathers its state
    shared over the ranks to rank 0 for the full format (Muon under DDP: whole_state_dict) leaves
    each rank its own, which DCP writes and reads rank by rank (a key only rank 1 holds, rank 1 writes)."""
    gathering = [o for o in _each(optimizer) if getattr(o, "whole_state_dict", False)]
    for o in gathering:
        o.whole_state_dict = False
    try:
        yield
    finally:
        for o in gathering:
            o.whole_state_dict = True


def sharded_meta(scaler, info, batches, param_groups, rt):
    """checkpoint.json's content: the small, plain part of the state. (cuda_rng is for readers of
    earlier versions; this one finds the RNG states a checkpoint carries in DCP's metadata.)"""
    return {
        **info,
        "format": "sharded",
        "world_size": rt.world_size,
        "cuda_rng": rt.device_type == "cuda",
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        "batches": batches.state_dict(),
        "param_groups": param_groups,
    }


def _check_sharded(path):
    """checkpoint.json of a complete sharded directory, after checking every shard DCP's
    .metadata names is there whole; one line otherwise."""
    from torch.distributed.checkpoint import FileSystemReader

    if not os.path.isfile(os.path.join(path, COMMIT)):
        raise UserError(
            f"{path} is incomplete (no {COMMIT}: its write was cut short); resume from an earlier checkpoint"
        )
    try:
        with open(os.path.join(path, COMMIT)) as f:
            meta = json.load(f)
        storage = FileSystemReader(path).read_metadata().storage_data
    except Exception:
        raise UserError(damaged(path, f"unreadable {COMMIT} or .metadata"))
    ends = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        shard = os.path.join(path, name)
        if not os.path.isfile(shard):
            raise UserError(
                f"{path} is missing its shard {name} (every rank writes one); copy the whole directory, "
                f"or resume from an earlier checkpoint"
            )
        if os.path.getsize(shard) < end:
            raise UserError(damaged(path, f"shard {name} is cut short"))
    return meta


def read_sharded(path):
    """A sharded checkpoint whole, in the full format's layout, in one process (no process group)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    meta = _check_sharded(path)
    single_process_is_meant()
    tensors = {}
    _load_state_dict(tensors, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    rng = {**_by_rank(tensors["rng"], meta["world_size"]), "batches": meta["batches"]}
    state = {k: v for k, v in meta.items() if k not in ("format", "world_size", "cuda_rng", "batches", "param_groups")}
    return {
        **state,
        "model": tensors["model"],
        "rng": rng,
        "optimizer": _indexed({"state": tensors["optimizer"], "param_groups": meta["param_groups"]}),
    }


def _load_sharded_into(state, raw_model, optimizer):
    """DCP reads each rank's part of the weights, optimizer state and every rank's RNG states
    straight into the (possibly sharded) model and optimizer, resharding when the world size changed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    single_process_is_meant()
    optimizers = _each(optimizer)
    with each_rank_its_own(optimizer):  # each rank reads its own Muon momenta only
        weights, optim = get_state_dict(raw_model, optimizers)  # the API takes a zero step to create empty AdamW state
        rng = _rng_placeholders(state["path"])
        dcp.load(
            {"model": weights, "optimizer": optim["state"], "rng": rng},
            checkpoint_id=state["path"],
            no_dist=not (dist.is_available() and dist.is_initialized()),
        )
        set_state_dict(
            raw_model,
            optimizers,
            model_state_dict=weights,
            optim_state_dict={"state": optim["state"], "param_groups": state["param_groups"]},
        )
    state["rng"] = {**_by_rank(rng, state["world_size"]), "batches": state["batches"]}


def _rng_placeholders(path):
    """Empty tensors shaped as every RNG state the directory holds (each rank's CPU one, and its
    CUDA or MPS one when written on such a device), for DCP to read into. Taken from DCP's own
    metadata, so no device is asked: a GPU's checkpoint loads on a CPU."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(path).read_metadata().state_dict_metadata
    return {
        key.removeprefix("rng."): torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in saved.items()
        if key.startswith("rng.")
    }


def _by_rank(rng, world_size):
    """{'torch_0': ..., 'cuda_0': ...} -> {'torch': [rank 0's, ...], 'cuda': [...]}, the full format's layout."""
    return {
        kind: [rng[f"{kind}_{r}"] for r in range(world_size)] for kind in ("torch", *DEVICE_RNGS) if f"{kind}_0" in rng
    }


def sharded_dirs(out_dir):
    return _numbered(out_dir, r"ckpt_(\d+)")


# ---------------------------------------------------------------------------- finding the newest


# keys that fix the model, the shapes of its weights and what it computes with them: a checkpoint
# only resumes under the same values
SHAPE_KEYS = (
    "n_layer",
    "n_head",
    "n_embd",
    "block_size",
    "bias",
    "vocab_size",
    "pos_encoding",
    "rope_theta",
    "norm",
    "mlp",
    "mlp_hidden",
    "n_kv_head",
    "qk_norm",
    "tie_embeddings",
    "rope_scaling",
    "norm_eps",
    # the speedrun levers
    "logit_softcap",
    "value_embeds",
    "unet_skips",
)


def check_resumable(saved, wanted):
    # through GPTConfig: a key older checkpoints lack takes its default, as it had then, and
    # "0 means the usual" keys compare by the sizes they stand for
    saved_cfg, wanted_cfg = GPTConfig(**saved), GPTConfig(**wanted)
    differ = [
        f"{k} {getattr(saved_cfg, k)} -> {getattr(wanted_cfg, k)}"
        for k in SHAPE_KEYS
        if getattr(saved_cfg, k) != getattr(wanted_cfg, k)
    ]
    if differ:
        raise UserError(
            f"cannot resume: the checkpoint's model differs in {', '.join(differ)}; use the config it was trained with"
        )


def resumable_model_args(state, cfg, model_args):
    """The GPTConfig arguments a run resuming from `state` builds its model with: the checkpoint's
    when cfg has the shape it was trained with (also when GPT-2's weights, init_from='gpt2...',
    gave it a shape other than these keys say), else model_args, which must match it. Refused in
    one line when the checkpoint's optimizer state or data position cannot go on under cfg."""
    trained_with = {**as_dict(TrainConfig()), **state["config"]}  # a key an older checkpoint lacks had its default
    if all(trained_with[k] == getattr(cfg, k) for k in SHAPE_KEYS if hasattr(cfg, k)):
        model_args = {**state["model_args"], "dropout": cfg.dropout}
    check_resumable(state["model_args"], model_args)
    if trained_with["optimizer"] != cfg.optimizer:
        raise UserError(
            f"cannot resume: the checkpoint was trained with optimizer={trained_with['optimizer']!r}, whose "
            f"state this run's optimizer={cfg.optimizer!r} cannot take; resume with --optimizer={trained_with['optimizer']}"
        )
    if trained_with["batch_order"] != cfg.batch_order:
        raise UserError(
            f"cannot resume: the checkpoint was trained with batch_order={trained_with['batch_order']!r}, whose "
            f"data position this run's {cfg.batch_order!r} cannot take; resume with --batch_order={trained_with['batch_order']}"
        )
    return model_args


def load_newest(out_dir, map_location="cpu", report=print):
    """The checkpoint in out_dir with the highest iter_num among those whole, of either format:
    ckpt.pt, a ckpt_<iter>.pt, or a complete ckpt_<iter>/ directory. A full one is loaded (memory-
    mapped); a sharded one is its checkpoint.json plus 'path', for restore() to read into the model."""
    latest = os.path.join(out_dir, "ckpt.pt")
    files = [latest] + [p for _, p in sorted(_numbered(out_dir).items(), reverse=True)]
    files = [p for p in files if os.path.isfile(p)]
    dirs = [p for _, p in sorted(sharded_dirs(out_dir).items(), reverse=True)]
    if not files and not dirs:
        return load(latest, map_location)  # its one-line "no checkpoint" error
    best, problems = None, []
    for path in files + dirs:
        try:
            if os.path.isdir(path):
                state = {**_check_sharded(path), "path": path}
            else:
                state = {**load(path, map_location, mmap=True), "format": "full", "path": path}
        except UserError as e:
            problems.append(str(e))
            continue
        if best is None or state["iter_num"] > best["iter_num"]:
            best = state
    if best is None:
        raise UserError(
            problems[0] if len(problems) == 1 else f"no readable checkpoint in {out_dir}: {'; '.join(problems)}"
        )
    for problem in problems:
        report(f"note: skipped {problem}")
    if problems or (best["format"] == "full" and best["path"] != latest):
        report(f"note: resuming from {best['path']} (iter {best['iter_num']}), the newest complete checkpoint")
    return best


def holds_checkpoint(path):
    """True when directory `path` holds a checkpoint of this trainer: a training run's out_dir."""
    if not os.path.isdir(path):
        return False
    files = any(os.path.isfile(os.path.join(path, name)) for name in ("ckpt.pt", "ckpt_best.pt"))
    return files or any(os.path.exists(os.path.join(p, COMMIT)) for p in sharded_dirs(path).values())


def load_model(out_dir, which="best", map_location="cpu", report=print):
    """(model, tokenizer description) from a training run's checkpoint of either format:
    ckpt_best.pt / ckpt_best when which='best' and it exists, else the newest; any other `which`
    names one (ckpt_<iter>.pt or ckpt_<iter>/ in out_dir, or a path). The model is in float32 on
    map_location. A sharded checkpoint is read in this one process, weights only."""
    if not os.path.isdir(out_dir):
        raise UserError(f"out_dir={out_dir} does not exist; point --out_dir at a training run's directory")
    best = [p for p in (os.path.join(out_dir, "ckpt_best.pt"), os.path.join(out_dir, "ckpt_best")) if os.path.exists(p)]
    if which not in ("best", "latest"):
        path = os.path.join(out_dir, which)  # an absolute `which` stays itself
    elif which == "best" and best:
        path = max(best, key=lambda p: os.lstat(p).st_mtime)  # the newer, should a run have changed format
    else:
        path = os.path.join(out_dir, "ckpt.pt")
        complete = [p for _, p in sorted(sharded_dirs(out_dir).items()) if os.path.exists(os.path.join(p, COMMIT))]
        if complete and (not os.path.exists(path) or os.path.getmtime(complete[-1]) > os.path.getmtime(path)):
            path = complete[-1]
    if os.path.isdir(path):
        import torch.distributed.checkpoint as dcp

        state = _check_sharded(path)
        single_process_is_meant()
        model = GPT(GPTConfig(**state["model_args"]))
        dcp.load({"model": model.state_dict()}, checkpoint_id=path, no_dist=True)  # into the model's own tensors
        model.to(map_location)
    else:
        state = load(path, map_location=map_location)
        model = GPT(GPTConfig(**state["model_args"]))
        model.load_state_dict(model_state(state))
    # checkpoints from nanoGPT carry no tokenizer: look in their data directory, as it did
    tok_spec = state.get("tokenizer") or tokenizer.describe(os.path.join("data", state["config"].get("dataset", "")))
    report(f"loaded {path} ({describe_val(state)})")
    return model, tok_spec


def describe_val(state):
    """'iter 1200, val loss 0.0275, the run's best' for a checkpoint, or where its best was when
    this is not it: a checkpoint saved between evals (a stop, the last step without an improvement)
    carries the best of the evals before it, not its own."""
    it, best, best_iter = state.get("iter_num", "?"), state.get("best_val_loss"), state.get("best_val_iter")
    if not isinstance(best, float) or best == float("inf"):
        return f"iter {it}, not evaluated"
    if best_iter == it:
        return f"iter {it}, val loss {best:.4f}, the run's best"
    if best_iter is None:  # a checkpoint from before best_val_iter was kept
        return f"iter {it}, best val loss so far {best:.4f}"
    return f"iter {it}; the run's best val loss before it: {best:.4f} at iter {best_iter}"


def model_state(state):
    """The model's state_dict from a checkpoint of ours or of nanoGPT: without the
    '_orig_mod.' prefix of a torch.compile'd model, and with the token embedding padded to
    the multiple of 64 rows our GPT allocates (nanoGPT's char models have exactly 65)."""
    weights = {k.removeprefix("_orig_mod."): v for k, v in state["model"].items()}
    rows = GPTConfig(vocab_size=state["model_args"]["vocab_size"]).padded_vocab_size
    for key in ("transformer.wte.weight", "lm_head.weight"):
        w = weights.get(key)
        if w is not None and w.size(0) < rows:
            weights[key] = torch.cat([w, w.new_zeros(rows - w.size(0), w.size(1))])
    return weights


def write_json(path, obj):
    """obj as path's JSON, replaced whole and synced: a reader sees the old file or the new one."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path)
