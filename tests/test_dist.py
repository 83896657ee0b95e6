"""What the multi-GPU command runs, on CPU processes over gloo: torchrun with compile=True under DDP
and FSDP2 (losses, graphs, an exact resume), a non-finite loss on one rank only (fp16), one eval
shape on every rank, and DDP's gradients held once (gradient_as_bucket_view).

The runs of tests/train_rank.py, in two torchrun launches (the copy at iter 4 needs a second; a launch
is ~11 CPU-s of imports): eager, ddp and fsdp in the first, resumed then nan_one_rank in the second:
  eager         DDP, not compiled: the reference; which rank writes and logs, the replicas' weights
  ddp, fsdp     DDP and FSDP2, compiled, 8 steps
  resumed       ddp's out_dir as it stood at iter 4, resumed to 8, compiling again
  nan_one_rank  fp16, not compiled, a NaN loss on rank 1 only; it fails
Every run evaluates 3 batches on 2 ranks, so one rank evaluates a padded batch. The ranks compile with
aot_eager (dynamo's and AOTAutograd's graphs, ATen's kernels): on a CPU inductor's g++ takes ~1.3 s a
kernel, 38 for the DDP run. Inductor on every Llama option: tests/test_compile.py."""

import gc
import shutil
import weakref

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import TINY as TINY_GPT
from conftest import assert_equal_states, assert_same_run, char_dataset, losses, read_metrics
from processes import TORCHRUN_ARGS, rank_reports, succeeded, torchrun
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from configurator import TrainConfig
from gpt.data.batches import TrainBatches, eval_offsets
from gpt.device import runtime
from gpt.train import auto_batch, step
from gpt.train.build import build
from model import GPT, GPTConfig

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo"
)

# 0.48M parameters, 1.9 MB of fp32 gradients: more than DDP's first bucket (1 MB), so DDP has
# two buckets and dynamo splits the compiled train graph between them
COMPILED_ARGS = [*TORCHRUN_ARGS, "--eval_iters=3", "--n_embd=128", "--mlp_hidden=512"]
# compiling with aot_eager, recording each rank's checkpoint writes, last weights and compile counters
RECORD = {"backend": "aot_eager", "record": True}
# fp16, a NaN loss on rank 1 at iters 3, 6 and 7 (test_one_rank_non_finite_loss_is_skipped_by_every_rank)
NAN_ONE_RANK = ["--dtype=float16", "--max_iters=10", "--eval_interval=100", "--max_bad_steps=2"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(root, {run: its ranks' reports, "launch exit": nan_one_rank's launch's exit code}): the module
    docstring's runs."""
    root = tmp_path_factory.mktemp("dist")
    chars = char_dataset(root / "chars")
    args = lambda name, *extra: [*COMPILED_ARGS, f"--dataset={chars}", f"--out_dir={root / name}", *extra]
    ddp = ["--compile=True", "--always_save_checkpoint=True", "--keep_last=2"]  # checkpoints at 4 and 8
    later = lambda name, *extra, options=RECORD: [str(root / name / "rank"), options, args(name, *extra)]
    fsdp = later("fsdp", "--compile=True", "--parallelism=fsdp")
    succeeded(torchrun(root, "eager", args("eager"), {**RECORD, "then": [later("ddp", *ddp), fsdp]}))
    # ddp's out_dir as it stood at iter 4, resumed: compiled again from nothing
    at_4 = shutil.ignore_patterns("ckpt.pt", "ckpt_best.pt", "ckpt_0000008.pt", "rank*")
    shutil.copytree(root / "ddp", root / "resumed", ignore=at_4)
    nan_one_rank = later("nan_one_rank", *NAN_ONE_RANK, options={**RECORD, "nan_at": [3, 6, 7], "nan_ranks": [1]})
    codes, _, _ = torchrun(
        root, "resumed", args("resumed", *ddp, "--init_from=resume"), {**RECORD, "then": [nan_one_rank]}
    )
    runs = {name: rank_reports(root / name) for name in ("eager", "ddp", "fsdp", "resumed", "nan_one_rank")}
    assert [r["exit"] for r in runs["resumed"]] == [0, 0], "".join(r["stderr"][-3000:] for r in runs["resumed"])
    return root, {**runs, "launch exit": codes[0]}


@pytest.mark.process
def test_compiled_ddp_and_fsdp_train_like_eager(compiled):
    root, _ = compiled
    eager, ddp, fsdp = (losses(root / name) for name in ("eager", "ddp", "fsdp"))
    assert len(eager) == len(ddp) == len(fsdp) == 8 + 3 * 2
    # float32: a compiled run may only add in another order (AOTAutograd's decompositions, FSDP2's
    # reduce-scatter); measured at most 4.8e-7 (2 ulp of a loss of 2-4), aot_eager or inductor. 2e-5 is
    # forty times that and thousands of times below one step's change of the loss (0.06 to 1.4): a graph
    # that missed an all-reduce, ran outside no_sync or evaluated stale weights could not stay within it
    assert max(abs(a - b) for a, b in zip(eager, ddp)) < 2e-5
    assert max(abs(a - b) for a, b in zip(eager, fsdp)) < 2e-5
    assert eager[-1] < eager[0] - 0.3  # and they learned


@pytest.mark.process
def test_only_rank_0_writes_and_logs_and_the_replicas_stay_equal(compiled):
    """Plain DDP (the eager launch): rank 0 alone writes checkpoints and logs a line per step, and DDP's
    all-reduce keeps the two replicas' weights equal."""
    root, runs = compiled
    out = root / "eager"
    assert "2 rank(s) x 2 micro-steps" in runs["eager"][0]["stdout"] and not runs["eager"][1]["stdout"]
    assert (out / "rank0.writes").read_text() and not (out / "rank1.writes").exists()
    w0, w1 = (torch.load(out / f"rank{r}.weights.pt", weights_only=True) for r in range(2))
    assert_equal_states(w0, w1)
    assert [r["iter"] for r in read_metrics(out) if "loss" in r] == list(range(8))


@pytest.mark.process
@pytest.mark.parametrize("name", ["ddp", "resumed", "fsdp"])
def test_compiled_run_has_one_train_graph_and_one_eval_graph(compiled, name):
    _, runs = compiled
    for rank in runs[name]:
        counters = rank["counters"]
        # training's graph (its backward with it) and eval's; a recompile after warm-up would add one.
        # Under FSDP2 dynamo leaves the root's forward eager (FSDP's hooks) and compiles the blocks'
        # forward (one graph for every block) and the final RMSNorm's: two for training, two for eval
        assert counters["stats"]["unique_graphs"] == (4 if name == "fsdp" else 2), counters
        # under DDP, DDPOptimizer splits the train graph at bucket boundaries: two pieces, and eval's
        assert counters["aot_autograd"]["total"] == (4 if name == "fsdp" else 3), counters
        assert sum(counters.get("recompiles", {}).values()) <= 1, counters
        assert not counters.get("graph_break"), counters


@pytest.mark.process
def test_compiled_ddp_resumes_exactly(compiled):
    root, runs = compiled
    assert "resuming at iter 4" in runs["resumed"][0]["stdout"]
    assert_same_run(root / "resumed", root / "ddp")  # bit for bit: the same compiled kernels, the same state
    assert torch.load(root / "ddp" / "ckpt.pt", weights_only=True)["iter_num"] == 8


@pytest.mark.process
def test_one_rank_non_finite_loss_is_skipped_by_every_rank(compiled):
    """fp16 (GradScaler on), a NaN loss on rank 1 only at iters 3, 6 and 7, max_bad_steps=2: rank 0
    reports rank 1's skip at iter 3, and at iter 7 both stop with the same line and exit code; none
    waits for the other (the launch would run past its timeout)."""
    _, runs = compiled
    ranks, code = runs["nan_one_rank"], runs["launch exit"]
    stdout = ranks[0]["stdout"]
    assert "iter 3: non-finite loss or gradient norm, 1 step(s) skipped since the last log (1 in a row)" in stdout
    assert "iter 4: loss" in stdout and "iter 7: loss" not in stdout
    assert [r["exit"] for r in ranks] == [3, 3] and code != 0
    lines = [r["stderr"].strip().splitlines() for r in ranks]
    assert lines[0] == lines[1] and len(lines[0]) == 1, lines
    assert lines[0][0].startswith("error: 2 steps in a row had a non-finite loss or gradient norm (max_bad_steps=2)")


# ---------------------------------------------------------------------------- in one process


TINY = dict(TINY_GPT, n_head=4, bias=False)


# (eval_iters, ranks, eval_group's budget in eval batches): shakespeare_char on 8 ranks
# (train_shakespeare_char.py: 200 batches of 64 x 256, 8 of whose logits fit eval_group's 64 MB),
# and uneven splits, where some ranks have a batch less than others
@pytest.mark.parametrize(
    "eval_iters, world_size, fits", [(200, 8, 8), (3, 2, 8), (7, 3, 2), (13, 2, 4), (4, 4, 8), (1, 2, 8)]
)
def test_every_rank_evaluates_one_shape_and_each_window_counts_once(monkeypatch, eval_iters, world_size, fits):
    B, T = 2, 16
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY)).eval()
    cfg, V = TrainConfig(batch_size=B, block_size=T, eval_iters=eval_iters), model.config.padded_vocab_size
    group = step.eval_group(cfg, V, world_size=world_size, budget_bytes=fits * B * T * V * 4)  # fits batches' logits
    data = np.random.default_rng(0).integers(0, 65, size=3000).astype(np.uint16)
    offsets = eval_offsets(data, eval_iters, B, T, 1)
    shapes, forwards, totals = set(), [], []
    model.register_forward_pre_hook(lambda m, args: shapes.add(tuple(args[0].shape)))
    # the all-reduce of the ranks' (loss sum, count), done here by adding them up
    monkeypatch.setattr(step.dist, "all_reduce", lambda t: totals.append(t.clone()))
    for rank in range(world_size):
        calls = []
        hook = model.register_forward_pre_hook(lambda m, args: calls.append(1))
        rt = runtime.Runtime("cpu", "cpu", torch.float32, rank, 0, world_size)
        step.evaluate(model, {"val": (data, offsets)}, T, rt, group)
        hook.remove()
        forwards.append(len(calls))
    assert len(shapes) == 1, shapes  # one shape, on every rank: one compiled eval graph
    assert len(set(forwards)) == 1  # as many forwards on every rank (FSDP: each is a collective)
    per_rank = -(-eval_iters // world_size)
    assert forwards[0] == -(-per_rank // min(fits, per_rank))  # as few as the budget allows
    loss_sum, count = sum(totals)
    rows = lambda o, shift: torch.from_numpy(data[o[:, None] + np.arange(shift, T + shift)].astype(np.int64))
    with torch.no_grad():  # each window once: the mean of the batches' mean losses
        reference = torch.stack([model(rows(o, 0), rows(o, 1))[1] for o in offsets]).mean()
    assert count == eval_iters * B * T
    assert (loss_sum / count).item() == pytest.approx(reference.item(), rel=1e-6)


def ddp_gradient_bytes():
    """(bytes held by gradients and buckets at each measure, the raw model, its parameters, a weak
    reference to the DDP model) of three steps of build's DDP train_model, in the process group
    already made. Nothing else refers to the DDP model when this returns."""
    # a one-process group builds DDP's reducer and buckets as more ranks do; world_size=2 makes build wrap it
    rt = runtime.Runtime("cpu", "cpu", torch.float32, rank=0, local_rank=0, world_size=2)
    cfg = TrainConfig(
        device="cpu", compile=False, n_layer=2, n_head=4, n_embd=32, block_size=16, dropout=0.0, bias=False
    )
    torch.manual_seed(0)
    raw_model = GPT(GPTConfig(**TINY))
    _, train_model, optimizer, scaler = build(raw_model, cfg, rt)
    assert isinstance(train_model, torch.nn.parallel.DistributedDataParallel)
    buckets = {}

    def recording_allreduce(state, bucket):
        buckets[bucket.index()] = bucket.buffer()
        return allreduce_hook(dist.group.WORLD, bucket)

    train_model.register_comm_hook(None, recording_allreduce)
    params = list(raw_model.parameters())
    held = []

    def measure(*_):  # the bytes of every distinct storage that a gradient or a bucket lives in
        tensors = [*buckets.values(), *(p.grad for p in params if p.grad is not None)]
        held.append(sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values()))

    data = np.random.default_rng(0).integers(0, 65, size=4000).astype(np.uint16)
    batches = TrainBatches(data, 4, 16, 0, rt)
    run_step = lambda: step.train_step(train_model, optimizer, scaler, batches, 1e-3, 2, 1.0, rt)
    for _ in range(2):  # DDP makes its buckets again in the order of the first backward, at the second step
        run_step()
    for p in params:  # after each gradient is accumulated, in every micro-step's backward
        p.register_post_accumulate_grad_hook(measure)
    for _ in range(3):
        run_step()
        measure()
    return held, raw_model, params, weakref.ref(train_model)


def test_ddp_holds_one_set_of_gradients_its_buckets(tmp_path):
    """build's DDP train_model keeps gradients as views into its all-reduce buckets through every
    micro-step (no_sync ones too) and from step to step: auto_batch.gradient_bytes, a float32 each."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        held, raw_model, params, ddp = ddp_gradient_bytes()
        gc.collect()  # DDP and its reducer let go of the group before the group is destroyed: in the other
        # order ProcessGroupGloo's destructor, run when the reducer went, once hung joining its threads
        assert ddp() is None
    finally:
        dist.destroy_process_group()
    assert len(held) == 3 * (2 * len(params) + 1)
    assert max(held) == auto_batch.gradient_bytes(raw_model) == 4 * sum(p.numel() for p in params)
