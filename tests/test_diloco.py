"""DiLoCo and LocalSGD on the replica groups (gpt/train/torchft_groups.py, sync_every): two groups of
one process each step alone and sync every H steps through torchft, checked against the groups' own
weights."""

import shutil

import pytest
import torch
from conftest import (
    char_dataset,
    ft_group,
    ft_parameter_bytes,
    needs,
    one_line_error,
    read_metrics,
    steps_by_iter,
    tiny_args,
)
from processes import finish, run_script

from gpt.outdir import checkpoint

needs("torchft")
pytestmark = pytest.mark.process  # every test here starts the groups' processes

H = 4
RUN = dict(max_iters=8, lr_decay_iters=8, eval_interval=2, keep_last=10, gradient_accumulation_steps=2, sync_every=H)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return char_dataset(tmp_path_factory.mktemp("chars"))


def pairs(data, root, runs):
    """Each run in `runs` (name -> train.py keys) as two groups at a lighthouse of their own, all at once; the
    lighthouses are the torchft_lighthouse command's servers, in this process (no interpreter each)."""
    from torchft.coordination import LighthouseServer

    started = []
    for name, keys in runs.items():
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
        procs = [
            ft_group(data, root / name, g, lighthouse.address(), root / f"{name}-group{g}.log", **keys)
            for g in range(2)
        ]
        started.append((lighthouse, procs))
    try:
        for _, procs in started:
            for proc in procs:
                finish(proc, timeout=240)
    finally:
        for lighthouse, _ in started:
            lighthouse.shutdown()
    return {name: root / name for name in runs}


def weights(out, g, it):
    return checkpoint.load(str(out / f"group{g}" / f"ckpt_{it:07d}.pt"))["model"]


def equal(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def diloco(data, tmp_path_factory):
    """The launches the tests share:
      whole     DiLoCo every H=4 steps (outer_lr 0.7, Nesterov 0.9), 8 steps, a checkpoint every 2
      localsgd  LocalSGD every 2 steps, 2 steps
      lr1       DiLoCo every 2 steps with outer_lr=1 and no momentum, 2 steps
      resumed   whole's ckpt_0000006.pt (between two syncs) alone, resumed to 8
    Nothing is sent before a sync, so whole's step-2 checkpoints hold the weights each group of
    localsgd and lr1 reached alone when they synced."""
    root = tmp_path_factory.mktemp("diloco")
    two = dict(RUN, max_iters=2, sync_every=2)
    localsgd, lr1 = {**two, "outer_method": "localsgd"}, {**two, "outer_lr": 1.0, "outer_momentum": 0.0}
    out = pairs(data, root, {"whole": RUN, "localsgd": localsgd, "lr1": lr1})
    for g in range(2):
        (root / "resumed" / f"group{g}").mkdir(parents=True)
        shutil.copy(out["whole"] / f"group{g}" / "ckpt_0000006.pt", root / "resumed" / f"group{g}")
    return {**out, **pairs(data, root, {"resumed": {**RUN, "init_from": "resume"}})}


def test_the_groups_are_equal_after_each_sync_and_apart_between(diloco):
    out = diloco["whole"]
    for it in range(2, 9, 2):
        assert equal(weights(out, 0, it), weights(out, 1, it)) == (it % H == 0), it


def test_a_sync_sends_the_parameters_once_every_h_steps(diloco):
    records = [steps_by_iter(diloco["whole"] / f"group{g}") for g in range(2)]
    size = ft_parameter_bytes(diloco["whole"])
    for r in records:
        assert [r[i]["sync_bytes"] for i in range(8)] == [size if (i + 1) % H == 0 else 0 for i in range(8)]
        # every-step averaging (test_replicas) sends `size` each step: H times as many bytes
        assert sum(r[i]["sync_bytes"] for i in range(8)) / 8 == size / H


def test_a_resume_between_syncs_goes_on_bit_for_bit(diloco):
    for g in range(2):
        whole, resumed = (steps_by_iter(diloco[name] / f"group{g}") for name in ("whole", "resumed"))
        assert sorted(whole) == list(range(8)) and sorted(resumed) == list(range(6, 8))
        assert [resumed[i]["loss"] for i in range(6, 8)] == [whole[i]["loss"] for i in range(6, 8)]
        assert equal(weights(diloco["whole"], g, 8), weights(diloco["resumed"], g, 8))
        vals = [
            {r["iter"]: r["val_loss"] for r in read_metrics(diloco[name] / f"group{g}") if "val_loss" in r}
            for name in ("whole", "resumed")
        ]
        assert vals[0][8] == vals[1][8]


def test_diloco_with_outer_lr_1_and_no_momentum_averages_the_weights(diloco):
    """LocalSGD is the average of the weights the groups reached alone (whole's at 2) bit for bit; DiLoCo
    (lr 1, no momentum) takes last - mean(last - w_g), the same up to rounding."""
    alone = [weights(diloco["whole"], g, 2) for g in range(2)]
    assert not equal(*alone)
    reference = {k: (alone[0][k] + alone[1][k]) / 2 for k in alone[0]}
    for method in ("localsgd", "lr1"):
        synced = [weights(diloco[method], g, 2) for g in range(2)]
        assert equal(*synced)
        for k in reference:
            if method == "localsgd":
                assert torch.equal(synced[0][k], reference[k]), k
            else:
                torch.testing.assert_close(synced[0][k], reference[k], rtol=0, atol=1e-6)


OUTER_ADAM = dict(sync_every=4, ft_replica_group=0, gradient_accumulation_steps=2, outer_method="adam")
SYNC_MISTAKES = {
    "no-replica-group": (dict(sync_every=4), "set --ft_replica_group too"),
    "outer-method": (OUTER_ADAM, "outer_method='adam' is not one of 'diloco', 'localsgd'"),
}


@pytest.mark.parametrize("mistake", SYNC_MISTAKES)
def test_sync_mistakes_are_one_line(data, tmp_path, mistake):
    keys, message = SYNC_MISTAKES[mistake]
    one_line_error(run_script("train.py", *tiny_args(data, tmp_path / "out", **keys)), message)


def test_a_skipped_step_still_counts_toward_the_sync():
    """A step skipped on a non-finite gradient norm still counts, or that group would sync a step late."""
    from gpt.train.torchft_groups import _Local

    p = torch.nn.Parameter(torch.ones(3))
    local, counted = _Local(torch.optim.SGD([p], lr=0.5)), []
    local.register_step_post_hook(lambda *_: counted.append(p.detach().clone()))
    p.grad = torch.ones(3)
    local.step()  # a step taken
    local.count_skipped()  # ...is counted once
    local.count_skipped()  # a step skipped: counted, nothing updated
    assert len(counted) == 2 and torch.equal(counted[0], torch.full((3,), 0.5)) and torch.equal(counted[1], counted[0])
