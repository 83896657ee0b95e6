"""Muon shared over ranks where some rank owns no matrix of a shape (fewer matrices of a shape than
ranks): such a rank resumes from either checkpoint format, under DDP and FSDP2, as the straight run
went on (docs/distributed.md). Each run is one torchrun of train.py (config/train_llama_1b.py at tiny
shapes), 6 steps, a checkpoint every 2, the sharded format unless a test says otherwise.

A resume equals its straight run exactly, except DDP over 4 ranks: the first step after a resume
all-reduces in DDP's first bucket layout, the straight run's in the rebuilt one, and gloo's ring adds
4 ranks' gradients in another order (1 ulp), so it is held to the DDP tests' tolerance."""

import shutil

import pytest
from conftest import char_dataset, losses, tiny_args
from processes import needs_gloo, run_python

pytestmark = [needs_gloo, pytest.mark.process]

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


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_4_ranks_owning_no_matrix_resume_from_the_sharded_format(data, tmp_path, parallelism):
    straight, again = tmp_path / f"{parallelism}4", tmp_path / f"{parallelism}4_2"
    on_ranks(4, data, straight, parallelism=parallelism)
    resumed(4, data, straight, again, 2, parallelism=parallelism)
    assert len(losses(straight)) == LOGGED
    if parallelism == "fsdp":
        assert losses(again) == losses(straight)
    else:
        assert losses(again) == pytest.approx(losses(straight), rel=1e-5, abs=1e-6)


def test_a_ddp_rank_owning_no_matrix_resumes_exactly_from_either_format(data, tmp_path):
    one_layer = dict(n_layer=1, gradient_accumulation_steps=2)
    on_ranks(2, data, tmp_path / "ddp2", **one_layer)
    resumed(2, data, tmp_path / "ddp2", tmp_path / "ddp2_2", 2, **one_layer, checkpoint_format="full")
    resumed(2, data, tmp_path / "ddp2_2", tmp_path / "ddp2_4", 4, **one_layer, checkpoint_format="full")
    assert (tmp_path / "ddp2_2" / "ckpt_0000004.pt").is_file()  # ddp2_4 resumed from the full format
    # the metrics carried over and those logged after each resume: exactly the straight run's
    assert losses(tmp_path / "ddp2_2") == losses(tmp_path / "ddp2_4") == losses(tmp_path / "ddp2")
    assert len(losses(tmp_path / "ddp2")) == LOGGED
