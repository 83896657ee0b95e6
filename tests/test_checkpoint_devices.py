"""Checkpoints across kinds of device, in the sharded and the full format: a GPU's resumes on a CPU,
a CPU's on a GPU. A GPU run's checkpoint adds each rank's CUDA generator state (sharded: DCP entries
rng.cuda_<rank> and checkpoint.json's cuda_rng; full: rng['cuda']). With no GPU here, a real CPU
checkpoint gets those entries as a GPU run writes them; resuming on a GPU has torch.cuda patched."""

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import CPU, char_dataset, tiny_args, untimed
from processes import run_script

from configurator import TrainConfig
from gpt.data.batches import TrainBatches, load_split
from gpt.device import runtime
from gpt.outdir import checkpoint
from gpt.train import optim
from gpt.train.step import train_step
from model import GPT, GPTConfig

# keep_last=2: the straight run keeps its iter-6 checkpoint (ckpt_0000006.pt) to resume from
COMMON = dict(max_iters=12, lr_decay_iters=12, eval_interval=6, dropout=0.1, keep_last=2)


def philox_state(seed, offset):
    """What torch.cuda.get_rng_state() returns: the seed and the offset as two little-endian uint64."""
    return torch.from_numpy(np.array([seed, offset], dtype="<u8").view(np.uint8).copy())


GPU_RNG = philox_state(1337, 4 * 96)  # the CUDA generator state the rewritten checkpoints hold


def train(data, out, **overrides):
    result = run_script("train.py", *tiny_args(data, out, **{**COMMON, **overrides}))
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def as_if_written_on_a_gpu(path):
    """Rewrite the checkpoint at `path` with the CUDA RNG states a 1-rank GPU run writes beside the rest."""
    if path.is_dir():
        from torch.distributed.checkpoint import FileSystemReader, save
        from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        tensors = {}
        _load_state_dict(
            tensors, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(), no_dist=True
        )
        meta = json.loads((path / checkpoint.COMMIT).read_text())
        assert meta["world_size"] == 1 and set(tensors["rng"]) == {"torch_0"}
        tensors["rng"]["cuda_0"] = GPU_RNG
        shutil.rmtree(path)
        save(tensors, checkpoint_id=str(path), no_dist=True)
        (path / checkpoint.COMMIT).write_text(json.dumps({**meta, "cuda_rng": True}))
    else:
        state = torch.load(path, weights_only=True)
        assert set(state["rng"]) == {"torch", "batches"}
        state["rng"]["cuda"] = [GPU_RNG]
        torch.save(state, path)


CHECKPOINTS = {"sharded": "ckpt_0000006", "full": "ckpt_0000006.pt"}  # each format's iter-6 checkpoint


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A CPU run of 12 steps (dropout on), and for each format an out_dir holding its checkpoint at
    iter 6 as the CPU wrote it (cpu_<format>) and as a GPU writes it (gpu_<format>): the full one is
    the straight run's as it stood at iter 6, the sharded one a run of 6 steps."""
    root = tmp_path_factory.mktemp("devices")
    data = char_dataset(root / "chars")
    train(data, root / "straight")
    later = shutil.ignore_patterns("ckpt.pt", "ckpt_best.pt", "ckpt_0000012.pt")
    shutil.copytree(root / "straight", root / "cpu_full", ignore=later)
    train(data, root / "cpu_sharded", max_iters=6, checkpoint_format="sharded")
    for fmt, name in CHECKPOINTS.items():
        shutil.copytree(root / f"cpu_{fmt}", root / f"gpu_{fmt}", symlinks=True)
        as_if_written_on_a_gpu(root / f"gpu_{fmt}" / name)
    return root


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_a_gpu_checkpoint_resumes_exactly_on_a_cpu(runs, fmt, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(runs / f"gpu_{fmt}", out, symlinks=True)  # the run rotates its checkpoints; the others read these
    resumed = train(runs / "chars", out, checkpoint_format=fmt, init_from="resume")
    assert "resuming at iter 6" in resumed.stdout
    assert "note: checkpoint was written on cuda, this run is on cpu: its cuda RNG state is unused" in resumed.stdout
    # the CPU generator is restored, the CUDA one has nothing to drive: the run continues as if never stopped
    assert untimed(out) == untimed(runs / "straight")


def test_a_sharded_gpu_checkpoint_reads_and_converts_in_one_cpu_process(runs, tmp_path):
    path = runs / "gpu_sharded" / "ckpt_0000006"
    whole = checkpoint.read_sharded(str(path))
    assert torch.equal(whole["rng"]["cuda"][0], GPU_RNG)
    result = run_script("scripts/checkpoint_convert.py", str(path), str(tmp_path / "full.pt"))
    assert result.returncode == 0, result.stderr
    assert torch.equal(checkpoint.load(str(tmp_path / "full.pt"))["rng"]["cuda"][0], GPU_RNG)


@pytest.fixture
def gpu(monkeypatch):
    """torch.cuda as a 1-GPU machine shows it, for restoring a checkpoint on 'cuda:0': set_rng_state
    records what it is given; get_rng_state must not be needed to read a checkpoint."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": calls.append((state.clone(), device)))

    def get_rng_state(device="cuda"):
        raise AssertionError("reading a checkpoint asked the GPU for its RNG state")

    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    cpu_rng = torch.get_rng_state()
    yield calls
    torch.set_rng_state(cpu_rng)  # restore_rng set this process's CPU generator


def restore_on(rt, out_dir):
    """(state, batch generator): train.py's restore of out_dir's newest checkpoint on device rt,
    short of moving the model there."""
    state = checkpoint.load_newest(str(out_dir))
    model = GPT(GPTConfig(**state["model_args"]))
    optimizer = optim.configure(model, TrainConfig(**state["config"]), "cpu")
    checkpoint.restore(state, model, optimizer, torch.amp.GradScaler("cpu", enabled=False), fsdp=False)
    batches = TrainBatches(np.zeros(32, np.uint16), 1, 8, 0, rt)  # the generator restore_rng sets
    checkpoint.restore_rng(state, batches, rt)
    return state, batches


@pytest.mark.parametrize("fmt", ["sharded", "full"])
@pytest.mark.parametrize("written_on", ["gpu", "cpu"])
def test_a_checkpoint_resumes_on_a_gpu(runs, gpu, fmt, written_on, capsys):
    """A GPU's checkpoint sets the GPU generator and says nothing of it; a CPU's sets none (the GPU
    generator keeps train.py's seed) and says the cuda RNG is reseeded. Both restore the CPU's."""
    state, batches = restore_on(runtime.Runtime("cuda:0", "cuda", torch.bfloat16), runs / f"{written_on}_{fmt}")
    said = capsys.readouterr().out
    if written_on == "gpu":
        assert len(gpu) == 1 and torch.equal(gpu[0][0], GPU_RNG) and gpu[0][1] == "cuda:0"
        assert "note:" not in said.replace("note: resuming from", "")
    else:
        assert (
            gpu == [] and "note: checkpoint was written on cpu, this run is on cuda: the cuda RNG is reseeded" in said
        )
    assert torch.equal(torch.get_rng_state(), state["rng"]["torch"][0])
    assert batches.rng.bit_generator.state == state["rng"]["batches"]


def as_if_written_on_a_mac(path):
    """Rewrite the checkpoint at `path` with the optimizer settings an MPS run saves: AdamW unfused."""
    if path.is_dir():
        meta = json.loads((path / checkpoint.COMMIT).read_text())
        assert all(group["fused"] for group in meta["param_groups"])
        (path / checkpoint.COMMIT).write_text(
            json.dumps({**meta, "param_groups": [{**group, "fused": False} for group in meta["param_groups"]]})
        )
    else:
        state = torch.load(path, weights_only=True)
        state["optimizer"]["param_groups"] = [{**group, "fused": False} for group in state["optimizer"]["param_groups"]]
        torch.save(state, path)


@pytest.mark.parametrize("fmt", CHECKPOINTS)
def test_the_optimizer_keeps_this_devices_implementation_across_a_resume(runs, fmt, tmp_path):
    out = tmp_path / "mac"
    shutil.copytree(runs / f"cpu_{fmt}", out, symlinks=True)
    as_if_written_on_a_mac(out / CHECKPOINTS[fmt])
    state = checkpoint.load_newest(str(out))
    cfg = TrainConfig(**state["config"])
    model = GPT(GPTConfig(**state["model_args"]))
    optimizer = optim.configure(model, cfg, "cpu")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    checkpoint.restore(state, model, optimizer, scaler, fsdp=False)
    assert all(group["fused"] for group in optimizer.param_groups)  # the CPU's fused AdamW, as built
    # a real step: step.py hands fused AdamW its skip flag (found_inf), which the unfused one refuses
    data = load_split(str(runs / "chars"), "train", "memmap")
    result = train_step(model, optimizer, scaler, TrainBatches(data, 4, 16, 0, CPU), 1e-3, 1, 1.0, CPU)
    assert bool(result.stepped) and torch.isfinite(result.loss)

    # the other way: the CPU's checkpoint (fused AdamW) restored for MPS, where AdamW is unfused
    state = checkpoint.load_newest(str(runs / f"cpu_{fmt}"))
    model = GPT(GPTConfig(**state["model_args"]))
    optimizer = optim.configure(model, cfg, "mps")
    checkpoint.restore(state, model, optimizer, scaler, fsdp=False)
    assert not any(group["fused"] for group in optimizer.param_groups)


def test_a_gpu_run_writes_its_cuda_rng_in_both_formats(monkeypatch):
    """The saving side on 'cuda:1' with torch.cuda simulated: each format carries the generator state
    torch.cuda.get_rng_state gives for this rank's device, under the keys the readers above expect."""
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": asked.append(device) or philox_state(7, 64))
    rt = runtime.Runtime("cuda:1", "cuda", torch.bfloat16)
    rng = checkpoint.gather_rng(rt)
    assert set(rng) == {"torch", "cuda"} and torch.equal(rng["cuda"][0], philox_state(7, 64))
    raw = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64, dropout=0.0))
    tensors, _ = checkpoint.sharded_state(raw, torch.optim.AdamW(raw.parameters()), rt)
    assert set(tensors["rng"]) == {"torch_0", "cuda_0"} and torch.equal(tensors["rng"]["cuda_0"], philox_state(7, 64))
    assert asked == ["cuda:1", "cuda:1"]
