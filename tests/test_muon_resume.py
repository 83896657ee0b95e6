"""Muon shared over ranks where some rank owns no matrix of a shape (fewer matrices of a shape than
ranks): such a rank resumes from either checkpoint format, under DDP and FSDP2, as the straight run
went on (docs/distributed.md).

The runs, each one torchrun of train.py (config/train_llama_1b.py at tiny shapes), 6 steps, a
checkpoint every 2, the sharded format unless said:
  ddp4        DDP over 4 ranks, 2 layers: each shape's 2 matrices on 2 ranks, none on the other 2
  ddp4_2      ddp4's checkpoint at 2 resumed
  ddp2        DDP over 2 ranks, 1 layer: rank 1 owns no matrix
  ddp2_2      ddp2's checkpoint at 2 resumed, writing the full format from there
  ddp2_4      ddp2_2's full checkpoint at 4 resumed
  fsdp4       FSDP2 over 4 ranks, 2 layers
  fsdp4_2     fsdp4's checkpoint at 2 resumed
A resumed run equals its straight run exactly, except DDP over 4 ranks: there the first step after
a resume all-reduces in DDP's first bucket layout, the straight run's step in the rebuilt one, and
gloo's ring adds 4 ranks' gradients in another order (1 ulp; the full format does the same), so
ddp4 is held to the DDP tests' tolerance. A rank waiting for ever fails its test at the launch's
timeout instead of blocking the suite."""

import shutil

import pytest
import torch.distributed as dist
from conftest import char_dataset, losses, tiny_args
from processes import run_python

pytestmark = [
    pytest.mark.skipif(
        not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
    ),
    pytest.mark.process,
]

LLAMA = dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=32, mlp_hidden=64, dtype="float32", optimizer="muon")
RUN = dict(batch_size=2, gradient_accumulation_steps=4, max_iters=6, lr_decay_iters=6, eval_interval=2)
RUN.update(eval_iters=1, always_save_checkpoint=True, keep_last=3, muon_weight_decay=0.01)
RUN.update(checkpoint_format="sharded")
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def on_ranks(nproc, data, out, timeout=240, **overrides):
    """train.py on nproc CPU ranks under one torchrun; killed (and the test failed) past `timeout`."""
    argv = ["config/train_llama_1b.py", *tiny_args(data, out, **{**LLAMA, **RUN, **overrides})]
    cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "train.py", *argv]
    result = run_python(cmd, env=ENV, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]


def at(src, dst, iter_num):
    """A copy of out_dir src as it stood at iter_num: its checkpoints up to it (either format), its metrics."""
    later = [f"ckpt_{i:07d}{ext}" for i in range(iter_num + 1, 7) for ext in ("", ".pt")]
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("ckpt.pt", "ckpt_best*", *later))


def resumed(nproc, data, src, dst, iter_num, **overrides):
    """dst: src's run resumed at iter_num on nproc ranks; returns dst."""
    at(src, dst, iter_num)
    on_ranks(nproc, data, dst, init_from="resume", **overrides)
    return dst


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return char_dataset(tmp_path_factory.mktemp("muon_resume") / "chars")


LOGGED = 6 + 2 * 4  # the losses of 6 steps and of 4 evals (at 0, 2, 4, 6), train and val


def test_ddp_ranks_owning_no_matrix_resume_from_the_sharded_format(data, tmp_path):
    on_ranks(4, data, tmp_path / "ddp4")
    resumed(4, data, tmp_path / "ddp4", tmp_path / "ddp4_2", 2)
    straight = losses(tmp_path / "ddp4")
    assert len(straight) == LOGGED
    assert losses(tmp_path / "ddp4_2") == pytest.approx(straight, rel=1e-5, abs=1e-6)


def test_a_ddp_rank_owning_no_matrix_resumes_exactly_from_either_format(data, tmp_path):
    on_ranks(2, data, tmp_path / "ddp2", n_layer=1, gradient_accumulation_steps=2)
    resumed(
        2,
        data,
        tmp_path / "ddp2",
        tmp_path / "ddp2_2",
        2,
        n_layer=1,
        gradient_accumulation_steps=2,
        checkpoint_format="full",
    )
    resumed(
        2,
        data,
        tmp_path / "ddp2_2",
        tmp_path / "ddp2_4",
        4,
        n_layer=1,
        gradient_accumulation_steps=2,
        checkpoint_format="full",
    )
    assert (tmp_path / "ddp2_2" / "ckpt_0000004.pt").is_file()  # ddp2_4 resumed from the full format
    # the metrics carried over and those logged after each resume: exactly the straight run's
    assert losses(tmp_path / "ddp2_2") == losses(tmp_path / "ddp2_4") == losses(tmp_path / "ddp2")
    assert len(losses(tmp_path / "ddp2")) == LOGGED


def test_fsdp_ranks_owning_no_matrix_resume_exactly(data, tmp_path):
    on_ranks(4, data, tmp_path / "fsdp4", parallelism="fsdp")
    resumed(4, data, tmp_path / "fsdp4", tmp_path / "fsdp4_2", 2, parallelism="fsdp")
    assert losses(tmp_path / "fsdp4_2") == losses(tmp_path / "fsdp4")
    assert len(losses(tmp_path / "fsdp4")) == LOGGED
