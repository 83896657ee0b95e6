"""The properties every kind of run shares, said once over a table of recipes.

RECIPES maps an id to the train.py flags of that kind of run, on top of COMMON (a tiny model, 8 steps
of 2 micro-steps, an eval and a kept checkpoint at iters 4 and 8); its data is made here (DATA).
plain runs with dropout (its resumes restore the masks' RNG streams too); the others without, so their
straight run, made once per session (`straight`), is also the one-process reference of 2 gloo ranks
(DDP, FSDP2; all in one torchrun launch, `two_ranks`; but for two recipes, said there). A kill -9 then
init_from=auto resumes at iter 4 exactly: every logged record but the timings, and the last checkpoint's
weights and optimizer state (conftest.assert_same_run). A recipe's own checks are the short tests at the end.

To add a recipe: a line in RECIPES (`dataset` names a maker in DATA), and, where its 2-rank run may
differ by more than float order in the reductions, its tolerance in TOLERANCE."""

import json
import shutil
import signal

import numpy as np
import pytest
import torch
from conftest import (
    GPT2,
    TINY_LLAMA,
    assert_equal_states,
    assert_same_run,
    bpe_eval_data,
    char_dataset,
    losses,
    needs,
    read_metrics,
    tiny_args,
    write_chat_dir,
)
from processes import needs_gloo, rank_reports, run_python, run_script, signalled_run, succeeded, torchrun

from gpt.data import token_files
from gpt.outdir import checkpoint
from gpt.weights import load
from model import GPT, GPTConfig

LEVERS = dict(mlp="relu2", zero_init_proj=True, logit_softcap=15.0, value_embeds=True, unet_skips=True, n_layer=3)
LLAMA = {k: v for k, v in TINY_LLAMA.items() if k not in ("vocab_size", "block_size", "dropout")}

# 8 steps of 2 micro-steps (a rank's each under 2 ranks), an eval and a kept checkpoint at 4 and 8
COMMON = dict(max_iters=8, lr_decay_iters=8, eval_interval=4, dropout=0.0, gradient_accumulation_steps=2, keep_last=2)
RECIPES = {
    "plain": dict(dropout=0.1),  # the dropout masks' generators restored too
    "levers-muon": dict(LEVERS, optimizer="muon"),  # the speedrun's levers (config/speedrun_shakespeare_cpu.py)
    "chat": dict(dataset="chat", block_size=32),  # conversations: the assistant's tokens are the targets
    "fp8": dict(dataset="bpe", fp8="emulate"),  # GPT-2's BPE: the fp8 checks export it to GGUF
    "wsd": dict(lr_schedule="wsd", decay_frac=0.25),  # stable to iter 6, then down to min_lr
    "documents": dict(dataset="documents", batch_order="documents", doc_mask=True),  # ~3 steps an epoch
    "llama": LLAMA,
}
# the largest gap a 2-rank run's losses and gradient norms may have to one process's: float order
# in the reductions (all-reduce, reduce-scatter) moves a loss of 2-11 by a few ulp. In FP8 an ulp can
# move a weight across a rounding boundary to the next e4m3 value, 1/8 away: measured 6.4e-4 (DDP)
# and 3.0e-3 (FSDP2) over 8 steps; a run without fp8 is 5.4e-2 away. FSDP2 sums the squares of a
# gradient norm shard by shard: over GPT-2's 50,257-row embedding that moved the norm by 3.2e-4
TOLERANCE = {"fp8": dict(abs=1e-2), "documents": dict(rel=1e-3)}


def documents(data_dir):
    """Short GPT-2 BPE-style documents, each followed by end-of-text as data/corpus.py writes them."""
    data_dir.mkdir()
    for split, n_docs in (("train", 40), ("val", 20)):
        lengths = np.random.default_rng(len(split)).integers(3, 30, size=n_docs)
        ids = [t for n in lengths for t in [*np.random.default_rng(n).integers(0, 300, n), 50256]]
        token_files.write(str(data_dir / f"{split}.bin"), np.array(ids, dtype=np.uint16))
    (data_dir / "meta.json").write_text(json.dumps(GPT2))
    return data_dir


DATA = {
    "chars": char_dataset,
    "chat": write_chat_dir,
    "bpe": lambda d: bpe_eval_data(d.mkdir() or d)[0],
    "documents": documents,
}


@pytest.fixture(scope="module")
def recipes(tmp_path_factory):
    """flags(recipe, out_dir, **overrides): its train.py flags; .run(recipe, name, **overrides): that
    run's out_dir, trained once; .straight(recipe): .run(recipe, "straight")."""
    root, made, runs = tmp_path_factory.mktemp("recipes"), {}, {}
    (root / "data").mkdir()

    def flags(recipe, out, **overrides):
        keys = {**COMMON, **RECIPES[recipe], **overrides}
        name = keys.pop("dataset", "chars")
        if name not in made:
            made[name] = DATA[name](root / "data" / name)
        return tiny_args(made[name], out, **keys)

    def run(recipe, name, **overrides):
        if (recipe, name) not in runs:
            out = root / recipe / name
            result = run_script("train.py", *flags(recipe, out, **overrides))
            assert result.returncode == 0, result.stderr
            runs[recipe, name] = out
            (out / "stdout.txt").write_text(result.stdout)
        return runs[recipe, name]

    flags.run, flags.straight = run, lambda recipe: run(recipe, "straight")
    return flags


def at_iter_4(recipes, recipe, to):
    """A copy at `to` of the recipe's straight out_dir as it stood at iter 4, to resume from."""
    later = shutil.ignore_patterns("ckpt.pt", "ckpt_best.pt", "ckpt_0000008.pt")
    return shutil.copytree(recipes.straight(recipe), to, ignore=later)


# ---------------------------------------------------------------------------- the properties


TWO_RANKS = [(r, p) for r in RECIPES if r not in ("wsd", "llama") for p in ("ddp", "fsdp")]


@pytest.fixture(scope="module")
def two_ranks(recipes, tmp_path_factory):
    """(the launch's exit codes and stderr, {run: its out_dir}): each of TWO_RANKS's runs on 2 gloo ranks,
    dropout off, one after another in one torchrun launch; each rank's reports in its out_dir."""
    root = tmp_path_factory.mktemp("two_ranks")
    runs = {(r, p): root / f"{r}-{p}" for r, p in TWO_RANKS}
    first, *then = [
        [str(out / "rank"), {"record": True}, recipes(r, out, dropout=0.0, parallelism=p)]
        for (r, p), out in runs.items()
    ]
    codes, stderr, _ = torchrun(root, runs[TWO_RANKS[0]].name, first[2], {"record": True, "then": then}, timeout=1200)
    return (codes, stderr), runs


@pytest.mark.process
@needs_gloo
# every recipe but wsd, whose schedule each rank computes alone (no collective: plain's runs hold for it),
# and llama, whose blocks train on 2 gloo ranks under DDP and FSDP2 in test_muon_dist.py's runs
@pytest.mark.parametrize("recipe, parallelism", TWO_RANKS, ids=["-".join(run) for run in TWO_RANKS])
def test_two_gloo_ranks_equal_one(recipes, two_ranks, recipe, parallelism):
    """2 ranks x 1 micro-step against 1 process x 2 micro-steps, dropout off (each rank draws its own
    masks): the same losses, gradient norms and trained tokens but for the float order of the
    reductions. Rank 0 alone logs; under DDP the two replicas end with the same weights, bit for bit.
    The runs are two_ranks's, one launch's."""
    one = recipes.straight(recipe) if not RECIPES[recipe].get("dropout") else recipes.run(recipe, "one", dropout=0.0)
    launch, runs = two_ranks
    two = runs[recipe, parallelism]
    ranks = succeeded((*launch, rank_reports(two)))
    assert all(line in ranks[0]["stdout"] for line in SAYS.get(recipe, [])) and not ranks[1]["stdout"]
    logged = lambda out: (
        losses(out)
        + [r[k] for r in read_metrics(out) if "loss" in r for k in ("grad_norm", "trained_tokens") if k in r]
    )
    a, b = logged(two), logged(one)
    assert len(a) == len(b) and len(losses(one)) == 8 + 3 * 2  # 8 steps, and evals at 0, 4 and 8
    assert a == pytest.approx(b, **TOLERANCE.get(recipe, dict(rel=1e-5, abs=1e-6)))
    assert losses(one)[7] < losses(one)[0]  # and it learned
    if parallelism == "ddp":
        w0, w1 = (torch.load(two / f"rank{r}.weights.pt", weights_only=True) for r in range(2))
        assert_equal_states(w0, w1)


@pytest.mark.process
@pytest.mark.parametrize("recipe", RECIPES)
def test_kill_9_then_init_from_auto_resumes_exactly(recipes, recipe, tmp_path):
    """A requeued job: killed after iter 4's checkpoint, with iters 4 and 5 logged since and out_dir's
    lock held by a dead process; the same command again resumes at iter 4 and ends as the straight run."""
    out = tmp_path / "out"
    args = recipes(recipe, out, init_from="auto")
    killed = signalled_run(tmp_path, "train.py", "SIGKILL", 6, args)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert [r["iter"] for r in read_metrics(out) if "loss" in r] == list(range(6))
    again = run_script("train.py", *args)
    assert again.returncode == 0, again.stderr
    assert f"init_from='auto': resuming the run in out_dir={out} (iter 4" in again.stdout
    assert "resuming at iter 4" in again.stdout
    assert_same_run(out, recipes.straight(recipe))


# ---------------------------------------------------------------------------- each recipe's own checks, on the same runs

SAYS = {  # what a recipe's run says of its data or model, once, on rank 0
    "chat": ["chat data: 200 conversations", "of positions are padding"],
    "fp8": ["fp8: 8 Linear layers in float8 (emulated"],
    "documents": ["documents: 40 in train"],
}


@pytest.mark.parametrize("recipe", SAYS)
def test_a_run_says_what_it_trains_on(recipes, recipe):
    said = (recipes.straight(recipe) / "stdout.txt").read_text()
    assert all(said.count(line) == 1 for line in SAYS[recipe]), said


@pytest.mark.process
def test_sigterm_checkpoints_exits_75_and_resumes_exactly(recipes, tmp_path):
    """SIGTERM (a preemption) at iter 6: a checkpoint at the next step boundary, exit 75; a resume is exact."""
    out = tmp_path / "out"
    stopped = signalled_run(tmp_path, "train.py", "SIGTERM", 6, recipes("plain", out))
    assert stopped.returncode == 75, stopped.stderr
    stopped_at = torch.load(out / "ckpt.pt", weights_only=True)["iter_num"]
    assert 6 <= stopped_at < 8 and f"stopped at iter {stopped_at} (SIGTERM)" in stopped.stdout
    resumed = run_script("train.py", *recipes("plain", out, init_from="resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert_same_run(out, recipes.straight("plain"))


def test_the_levers_and_both_optimizers_are_in_the_checkpoint(recipes, tmp_path):
    """The levers' keys and weights, Muon's momenta and AdamW's moments kept; dropping a lever is refused."""
    straight = recipes.straight("levers-muon")
    state = torch.load(straight / "ckpt.pt", weights_only=True)
    assert all(state["model_args"][k] == v for k, v in LEVERS.items())
    assert any(k.startswith("transformer.ve.") for k in state["model"]) and "skip_weights" in state["model"]
    model, _ = load.for_inference("resume", str(straight), report=lambda *_: None)
    assert all(getattr(model.config, k) == v for k, v in LEVERS.items())
    assert len(state["optimizer"]["optimizers"]) == 2 and all(o["state"] for o in state["optimizer"]["optimizers"])
    split = at_iter_4(recipes, "levers-muon", tmp_path / "split")
    result = run_script("train.py", *recipes("levers-muon", split, unet_skips=False, init_from="resume"))
    assert result.returncode != 0 and "unet_skips True -> False" in result.stderr


def test_wsd_run_extended_from_its_stable_phase_resumes_exactly(recipes, tmp_path):
    """A 6-step run's iter-4 checkpoint (stable phase), resumed with max_iters=8, equals the 8-step run."""
    planned = tmp_path / "planned6"
    result = run_script("train.py", *recipes("wsd", planned, max_iters=6))
    assert result.returncode == 0, result.stderr
    shutil.copytree(planned, tmp_path / "extended", ignore=shutil.ignore_patterns("ckpt.pt", "ckpt_best.pt", "*6.pt"))
    extended = run_script("train.py", *recipes("wsd", tmp_path / "extended", init_from="resume"))
    assert extended.returncode == 0, extended.stderr
    assert_same_run(tmp_path / "extended", recipes.straight("wsd"))
    lrs = [r["lr"] for r in read_metrics(recipes.straight("wsd")) if "lr" in r]
    assert lrs[2:7] == [1e-2] * 5  # stable through iter 6, then the decay
    assert lrs[7] == pytest.approx(1e-2 + 1 / 2 * (1e-3 - 1e-2))  # down to min_lr at 8


def test_documents_resume_mid_epoch_and_refuse_another_order(recipes, tmp_path):
    """The resume at iter 4 is inside an epoch, the run crosses into the next; batch_order='random' is refused."""
    straight = recipes.straight("documents")
    at_4 = torch.load(straight / "ckpt_0000004.pt", weights_only=True)["rng"]["batches"]
    assert (
        at_4["position"] > 0
        and at_4["epoch"] < torch.load(straight / "ckpt.pt", weights_only=True)["rng"]["batches"]["epoch"]
    )
    split = at_iter_4(recipes, "documents", tmp_path / "split")
    other = run_script("train.py", *recipes("documents", split, batch_order="random", init_from="resume"))
    assert other.returncode != 0 and "batch_order='documents'" in other.stderr and "Traceback" not in other.stderr


def test_a_chat_run_logs_the_trained_tokens_of_each_step(recipes):
    records = read_metrics(recipes.straight("chat"))
    steps = {r["iter"]: (r["loss"], r["trained_tokens"]) for r in records if "loss" in r}
    assert all(0 < n < 2 * 4 * 32 for _, n in steps.values()) and steps[7][0] < steps[0][0]
    assert "val_bpb" not in [r for r in records if "val_loss" in r][-1]  # no bits per byte over masked targets


# ---------------------------------------------------------------------------- fp8's checkpoint, read where torchao is not


def test_the_fp8_checkpoint_holds_plain_float32_weights_under_plain_names(recipes):
    state = torch.load(recipes.straight("fp8") / "ckpt.pt", weights_only=True)  # no torchao class in it
    assert state["config"]["fp8"] == "emulate"
    assert state["model"].keys() == GPT(GPTConfig(**state["model_args"])).state_dict().keys()
    assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in state["model"].values())


@pytest.mark.process
def test_the_fp8_checkpoint_samples_where_torchao_cannot_be_imported(recipes):
    """sample.py in a fresh interpreter whose `import torchao` fails, as on a machine without it."""
    out = recipes.straight("fp8")
    blocked = "import runpy, sys; sys.modules['torchao'] = None; sys.argv[0] = 'sample.py'; runpy.run_path('sample.py', run_name='__main__')"
    args = [f"--out_dir={out}", "--device=cpu", "--num_samples=1", "--max_new_tokens=8", "--stop_at_eot=False"]
    result = run_python(["-c", blocked, *args, "--start=The"], timeout=120)
    assert result.returncode == 0, result.stderr
    loaded, sample, _ = result.stdout.split("\n", 2)
    best = torch.load(out / "ckpt_best.pt", weights_only=True)["iter_num"]
    assert loaded.startswith(f"loaded {out / 'ckpt_best.pt'} (iter {best}")
    assert sample.startswith("The") and len(sample) > len("The")  # the prompt and 8 tokens on one line
    assert result.stderr.startswith("8 tokens in")


def test_an_fp8_run_exports_to_hugging_face_and_gguf(recipes, tmp_path):
    needs("transformers", "gguf")
    import gguf
    import transformers

    out = recipes.straight("fp8")
    assert run_script("hf.py", f"--out_dir={out}", f"--export_dir={tmp_path / 'hf'}").returncode == 0
    model, _ = checkpoint.load_model(str(out), report=lambda _: None)
    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model.eval()(idx, logits_at="all")[0]
        theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()(idx).logits
    assert (ours - theirs).abs().max() < 1e-5

    assert run_script("hf.py", f"--out_dir={out}", "--format=gguf", f"--export_dir={tmp_path}").returncode == 0
    tensors = {t.name: t for t in gguf.GGUFReader(tmp_path / "model.gguf").tensors}
    assert np.array_equal(tensors["token_embd.weight"].data, model.transformer.wte.weight[:50257].detach().numpy())
    c_fc = model.transformer.h[1].mlp.c_fc.weight.detach().numpy()  # a layer that trained in float8
    assert np.array_equal(tensors["blk.1.ffn_up.weight"].data, c_fc)
