"""Muon beside AdamW, the warmup-stable-decay schedule, and the training-health metrics (gradient norm,
clipping, update ratios): against torch's Muon, by hand, and through train.py's log. (Resume, 2 ranks,
kill -9 with Muon and with WSD: tests/test_recipes.py.)"""

import copy

import numpy as np
import pytest
import torch
from conftest import CPU, TINY, char_dataset, count_host_reads, read_metrics, tiny_args
from processes import run_script
from torch.utils._python_dispatch import TorchDispatchMode
from train_rank import nan_loss

import configurator
from configurator import TrainConfig, UserError
from gpt.data import tokenizer
from gpt.data.batches import TrainBatches, load_split
from gpt.train import muon, optim
from gpt.train.build import make_model_args
from gpt.train.optim import get_lr
from gpt.train.step import train_step
from model import GPT, GPTConfig

MODEL = dict(TINY, bias=True)


# ---------------------------------------------------------------------------- the optimizer


def test_muon_half_steps_as_torch_muon_and_the_rest_as_adamw(monkeypatch):
    # on a CPU ours orthogonalizes in float32; in torch's bfloat16 it must be torch's step, bit for bit
    monkeypatch.setattr(muon, "CPU_NS_DTYPE", torch.bfloat16)
    # compile=False: inductor's iteration rounds its own way (test_compiled_muon_steps_as_eager)
    keys = dict(optimizer="muon", compile=False, muon_lr=0.03, muon_momentum=0.9, muon_weight_decay=0.05)
    keys.update(learning_rate=1e-2, weight_decay=0.1, warmup_iters=1, max_iters=4, lr_decay_iters=4, min_lr=1e-3)
    cfg = TrainConfig(**keys)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    ref = copy.deepcopy(model)
    init = copy.deepcopy(model.state_dict())
    ours = optim.configure(model, cfg, "cpu")
    names = {p: n for n, p in model.named_parameters()}
    muon_names = [names[p] for p in ours.optimizers[0].param_groups[0]["params"]]
    # the blocks' projections, every one; no embedding, lm_head, norm or bias
    matrices = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    assert sorted(muon_names) == sorted(f"transformer.h.{i}.{m}.weight" for i in range(2) for m in matrices)
    ref_named = dict(ref.named_parameters())
    ref_muon = torch.optim.Muon([ref_named[n] for n in muon_names], lr=cfg.muon_lr, momentum=0.9, weight_decay=0.05)
    adamw_params = [p for n, p in ref_named.items() if n not in muon_names]
    ref_adamw = ref.configure_optimizers(0.1, cfg.learning_rate, (cfg.beta1, cfg.beta2), "cpu", params=adamw_params)
    g = torch.Generator().manual_seed(1)
    for it in range(4):
        x, y = torch.randint(0, 65, (4, 16), generator=g), torch.randint(0, 65, (4, 16), generator=g)
        lr = get_lr(it, cfg)
        train_step(model, ours, torch.amp.GradScaler("cpu", enabled=False), lambda: (x, y), lr, 1, 0.0, CPU)
        ref(x, y)[1].backward()
        # Muon's peak on the same schedule, AdamW's the schedule's
        for opt, opt_lr in ((ref_muon, cfg.muon_lr * lr / cfg.learning_rate), (ref_adamw, lr)):
            for group in opt.param_groups:
                group["lr"] = opt_lr
            opt.step()
            opt.zero_grad(set_to_none=True)
    moved = 0.0
    for name, p in model.named_parameters():
        assert torch.equal(p, ref_named[name]), name  # the same kernels on the same numbers: bit for bit
        moved = max(moved, (p - init[name]).abs().max().item())
    assert moved > 1e-3


def test_muon_on_a_cpu_orthogonalizes_in_float32_closer_to_the_exact_iteration_than_bfloat16():
    torch.manual_seed(0)
    coefficients = (3.4445, -4.7750, 2.0315)
    for shape in ((48, 16), (16, 48), (32, 32)):
        m = torch.randn(shape)
        exact = muon.orthogonalize(m[None].double(), (coefficients,) * 5, 1e-7)[0]
        ours = muon.orthogonalize(m[None].to(muon.CPU_NS_DTYPE), (coefficients,) * 5, 1e-7)[0]
        torchs = torch.optim._muon._zeropower_via_newtonschulz(m, coefficients, 5, 1e-7)
        # the same iteration
        assert torch.equal(muon.orthogonalize(m[None].bfloat16(), (coefficients,) * 5, 1e-7)[0], torchs)
        assert ours.dtype == torch.float32 and (ours.double() - exact).abs().max() < 1e-5
        assert (torchs.double() - exact).abs().max() > 1e-3  # bfloat16's 8 bits of mantissa
        # and it orthogonalizes: singular values pushed into Newton-Schulz's band around 1
        s = torch.linalg.svdvals(ours)
        assert s.min() > 0.5 and s.max() < 1.5


# several matrices of each shape (so the stacks have more than one), tall, wide and square
SHAPES = [(48, 16), (16, 48), (48, 16), (32, 32), (16, 48), (32, 32), (48, 16), (8, 24)]


def muon_pair(options, seed=0):
    """Our Muon and torch's on two copies of the same matrices."""
    torch.manual_seed(seed)
    ours = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    return ours, theirs, muon.Muon(ours, **options), torch.optim.Muon(theirs, **options)


def step_both(ours, theirs, opt, ref, steps=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()


@pytest.mark.parametrize(
    "options",
    [
        dict(lr=0.02, momentum=0.9, weight_decay=0.05),
        dict(lr=0.05, momentum=0.95, weight_decay=0.0, nesterov=False, adjust_lr_fn="match_rms_adamw"),
    ],
)
def test_batched_muon_steps_every_matrix_as_torch_muon(monkeypatch, options):
    # in torch's bfloat16 the stacked iteration is torch's, matrix for matrix: bit for bit
    monkeypatch.setattr(muon, "CPU_NS_DTYPE", torch.bfloat16)
    ours, theirs, opt, ref = muon_pair(options)
    step_both(ours, theirs, opt, ref)
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))
    for p, q in zip(ours, theirs):  # and the state: checkpoints move between the two
        assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])
    # in float32 (a CPU's), each matrix within bfloat16's rounding of torch's updates: each step's
    # elements are below 2 (times lr and the shape's ratio), rounded to 8 bits of mantissa
    monkeypatch.setattr(muon, "CPU_NS_DTYPE", torch.float32)
    ours, theirs, opt, ref = muon_pair(options)
    step_both(ours, theirs, opt, ref)
    for p, q in zip(ours, theirs):
        ratio = muon.adjusted_lr_ratio(options.get("adjust_lr_fn"), p.shape)
        gap = (p - q).abs().max().item()
        assert 0 < gap < 3 * 2 * options["lr"] * ratio * 2**-8, (p.shape, gap)


def test_muon_off_the_cpu_orthogonalizes_in_bfloat16():
    """The device branch on the meta device (any but the CPU takes it): bfloat16 matmuls there, float32 on the CPU."""

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.dtypes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default):
                self.dtypes.add(args[0].dtype)
            return func(*args, **(kwargs or {}))

    for device, dtype in (("meta", torch.bfloat16), ("cpu", torch.float32)):
        params = [torch.nn.Parameter(torch.zeros(shape, device=device)) for shape in SHAPES]
        for p in params:
            p.grad = torch.ones_like(p)
        with Matmuls() as seen:
            muon.Muon(params, lr=0.02).step()
        assert seen.dtypes == {dtype}, device


@pytest.mark.parametrize(
    "levers, state",
    [
        ({}, {"momentum_buffer"}),
        (dict(polar_express=True, normuon=True, cautious=True), {"momentum_buffer", "second_moment"}),
    ],
    ids=["plain", "levers"],
)
def test_compiled_muon_steps_as_eager(aten_compile, levers, state):
    """train.py's compile=True compiles each shape's step (here run by ATen's kernels): one graph per
    shape for the whole step, whatever the levers (they are constants in it), no recompiles over 5 steps."""
    ours, eager, _, _ = muon_pair(dict(lr=0.02, momentum=0.9, weight_decay=0.05))  # torch's Muon has no levers
    options = dict(lr=0.02, momentum=0.9, weight_decay=0.05, **levers)
    ref = muon.Muon(eager, **options)
    compiled = muon.Muon(ours, compile=True, **options)
    step_both(ours, eager, compiled, ref)
    for opt in (compiled, ref):  # the schedule moves the learning rate: an input of the graph, not a constant
        opt.param_groups[0]["lr"] = 0.013
    step_both(ours, eager, compiled, ref, steps=2, seed=2)
    assert aten_compile["stats"]["unique_graphs"] == len(set(SHAPES))
    for p, q in zip(ours, eager):
        assert (p - q).abs().max() < 1e-5
    assert set(ref.state[eager[0]]) == set(compiled.state[ours[0]]) == state


def test_a_skipped_muon_step_leaves_weights_and_momenta_bit_unchanged_without_a_host_read(aten_compile, monkeypatch):
    """train_step hands Muon (compiled, run by ATen's kernels) beside fused AdamW its skip flag on the device,
    as it does fused AdamW alone: a non-finite step changes nothing, and no step reads the device."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    opt = optim.configure(model, TrainConfig(optimizer="muon", learning_rate=1e-2, muon_lr=0.02), "cpu")
    assert opt._step_supports_amp_scaling
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    data = np.random.default_rng(0).integers(0, 65, size=2000).astype(np.uint16)
    batches = TrainBatches(data, 4, 16, 0, CPU)
    train_step(model, opt, scaler, batches, 1e-2, 2, 1.0, CPU)  # the states exist from here
    before = [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict())
    reads = count_host_reads(monkeypatch)
    with nan_loss(model):
        poisoned = train_step(model, opt, scaler, batches, 1e-2, 2, 1.0, CPU)
    assert reads == []
    monkeypatch.undo()
    assert not bool(poisoned.stepped)
    assert all(torch.equal(a, b) for a, b in zip(before[0], model.parameters()))
    for a, b in zip(before[1]["optimizers"], opt.state_dict()["optimizers"]):
        assert all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])
    good = train_step(model, opt, scaler, batches, 1e-2, 2, 1.0, CPU)
    assert bool(good.stepped) and not all(torch.equal(a, b) for a, b in zip(before[0], model.parameters()))


def test_polar_express_lands_closer_to_the_polar_factor_than_torchs_iteration():
    """Against the SVD's U V^T, on ill-conditioned matrices in float64: five tuned quintics against torch's one."""
    torch.manual_seed(0)
    for shape in ((64, 16), (16, 64), (32, 32)):
        u, s, vh = torch.linalg.svd(torch.randn(shape, dtype=torch.float64), full_matrices=False)
        m = u @ torch.diag(torch.logspace(0, -3, len(s), dtype=torch.float64)) @ vh  # singular values 1 .. 1e-3
        polar = u @ vh
        torchs = muon.orthogonalize(m[None], ((3.4445, -4.7750, 2.0315),) * 5, 1e-7)[0]
        pe = muon.orthogonalize(m[None], muon.POLAR_EXPRESS, 1e-7, muon.POLAR_EXPRESS_SAFETY)[0]
        assert (pe - polar).norm() < 0.7 * (torchs - polar).norm(), shape


def test_normuon_evens_out_the_neurons_and_keeps_the_norm():
    """A first step: every row of a tall matrix (column of a wide one) with the same RMS, each matrix's Frobenius
    norm kept; the state is the running mean of the squares, (1 - 0.95) of this step's."""
    torch.manual_seed(0)
    for shape, dim in (((3, 48, 16), -1), ((3, 16, 48), -2)):
        o = torch.randn(shape) * torch.linspace(0.1, 3, shape[1])[:, None]
        seconds = [torch.zeros(muon.state_shape("second_moment", o[0])) for _ in range(3)]
        y = muon.normalize_neurons(o, seconds, None)
        rms = y.square().mean(dim=dim)
        torch.testing.assert_close(rms, rms.mean(dim=-1, keepdim=True).expand_as(rms))
        torch.testing.assert_close(y.norm(dim=(-2, -1)), o.norm(dim=(-2, -1)))
        torch.testing.assert_close(torch.stack(seconds), 0.05 * o.square().mean(dim=dim, keepdim=True))


def test_cautious_weight_decay_decays_only_where_the_update_agrees_in_sign():
    p = torch.tensor([[1.0, -1.0], [2.0, -2.0]])
    u = torch.tensor([[[0.5, 0.5], [-0.5, -0.5]]])  # agrees with p at (0, 0) and (1, 1)
    group = {"nesterov": True, "ns_coefficients": (1, 0, 0), "ns_steps": 1, "eps": 1e-7, "weight_decay": 0.1}
    it = muon.Muon([torch.nn.Parameter(p)], cautious=True, weight_decay=0.1).iteration(group, p.device)
    q = p.clone()
    muon.apply([q], u, {"decay": 0.9, "-lr*ratio": -0.1}, None, it)
    decay = torch.tensor([[0.9, 1.0], [1.0, 0.9]])
    torch.testing.assert_close(q, p * decay - 0.1 * u[0])


def test_muon_unscales_fp16_gradients_it_is_handed_scaled():
    """GradScaler's protocol: a gradient still multiplied by the loss scale comes with grad_scale."""
    options = dict(lr=0.02, momentum=0.9, weight_decay=0.05)
    ours, theirs, opt, _ = muon_pair(options)
    ref = muon.Muon(theirs, **options)
    for p, q in zip(ours, theirs):
        q.grad = torch.randn(q.shape)
        p.grad = q.grad * 1024
    opt.grad_scale, opt.found_inf = torch.tensor(1024.0), torch.tensor(0.0)
    opt.step()
    ref.step()
    assert all(torch.equal(p, q) for p, q in zip(ours, theirs))  # a power of two: exact


def test_optimizers_state_dict_round_trip_keeps_this_runs_muon_lr(aten_compile):  # compile=True, the default
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    first = optim.configure(model, TrainConfig(optimizer="muon", learning_rate=1e-2, muon_lr=0.02), "cpu")
    x = torch.randint(0, 65, (2, 16))
    model(x, x)[1].backward()
    first.step()
    saved = copy.deepcopy(first.state_dict())
    second = optim.configure(model, TrainConfig(optimizer="muon", learning_rate=1e-2, muon_lr=0.04), "cpu")
    second.load_state_dict(saved)
    assert second.param_groups[0]["lr_scale"] == pytest.approx(4.0)  # the resumed run's muon_lr, not the saved one
    assert len(second.param_groups) == 3  # Muon's group and AdamW's two, read after the load replaced them
    for a, b in zip(first.optimizers, second.optimizers):
        for p in a.state:
            assert all(torch.equal(a.state[p][k], b.state[p][k]) for k in a.state[p])


# ---------------------------------------------------------------------------- WSD schedule


def wsd(**overrides):
    args = dict(lr_schedule="wsd", learning_rate=1e-3, min_lr=1e-4, warmup_iters=10, max_iters=100, decay_frac=0.2)
    return TrainConfig(**{**args, **overrides})


def test_wsd_shape():
    cfg = wsd()
    lrs = np.array([get_lr(it, cfg) for it in range(cfg.max_iters + 1)])
    cosine = TrainConfig(learning_rate=1e-3, min_lr=1e-4, warmup_iters=10, lr_decay_iters=100)
    assert list(lrs[:10]) == [get_lr(it, cosine) for it in range(10)]  # the same linear warmup
    assert set(lrs[10:80]) == {cfg.learning_rate}  # stable until the last 20% of max_iters
    steps = np.diff(lrs[80:])
    np.testing.assert_allclose(steps, (cfg.min_lr - cfg.learning_rate) / 20, rtol=1e-9)  # a straight line down...
    assert lrs[100] == pytest.approx(cfg.min_lr) and get_lr(10**6, cfg) == pytest.approx(cfg.min_lr)  # ...to min_lr
    # decay_frac=1 decays from the end of warmup, never below it during warmup
    whole = [get_lr(it, wsd(decay_frac=1.0)) for it in range(100)]
    assert whole[10] == cfg.learning_rate and all(b < a for a, b in zip(whole[10:], whole[11:]))
    # a larger max_iters moves only the decay: every step before the old decay is unchanged
    longer = wsd(max_iters=400)
    assert [get_lr(it, longer) for it in range(80)] == list(lrs[:80])
    # decay_lr=False still means a constant learning rate
    assert {get_lr(it, wsd(decay_lr=False)) for it in (0, 50, 99)} == {cfg.learning_rate}


# ---------------------------------------------------------------------------- Muon end to end


@pytest.fixture(scope="module")
def muon_runs(tmp_path_factory):
    """40 steps of Muon, dropout on, update ratios every 10 steps, some steps clipped and some not."""
    root = tmp_path_factory.mktemp("muon")
    data = char_dataset(root / "chars")
    common = dict(optimizer="muon", max_iters=40, lr_decay_iters=40, eval_interval=10, dropout=0.1)
    common.update(update_ratio_interval=10, grad_clip=1.5)
    result = run_script("train.py", *tiny_args(data, root / "straight", **common))
    assert result.returncode == 0, result.stderr
    return root, data, common


def test_logged_grad_norm_and_update_ratios(muon_runs):
    """Step 0's logged gradient norm against one computed here: the same seed's model, batch and dropout masks."""
    root, data, common = muon_runs
    evals = [r["val_loss"] for r in read_metrics(root / "straight") if "val_loss" in r]
    assert evals[-1] < evals[0] - 0.5  # it learned
    cfg = configurator.parse(TrainConfig, tiny_args(data, root / "straight", **common))
    train_data = load_split(str(data), "train")
    torch.manual_seed(cfg.seed)
    model = GPT(GPTConfig(**make_model_args(cfg, tokenizer.vocab_size(tokenizer.describe(str(data))))))
    x, y = TrainBatches(train_data, cfg.batch_size, cfg.block_size, cfg.seed, CPU)()
    model(x, y)[1].backward()
    by_hand = sum(float((p.grad.double() ** 2).sum()) for p in model.parameters()) ** 0.5

    steps = [r for r in read_metrics(root / "straight") if "loss" in r]
    assert steps[0]["grad_norm"] == pytest.approx(by_hand, rel=1e-5)
    assert all(r["clipped"] == (r["grad_norm"] > cfg.grad_clip) for r in steps)
    assert any(r["clipped"] for r in steps) and not all(r["clipped"] for r in steps)  # both cases occur

    ratios = [r for r in read_metrics(root / "straight") if "update_ratio/h.0" in r]
    assert [r["iter"] for r in ratios] == [0, 10, 20, 30]
    for r in ratios:
        assert set(r) == {"iter"} | {f"update_ratio/{n}" for n in ("wte", "wpe", "h.0", "h.1", "ln_f")}
        assert all(0 < v < 1 for k, v in r.items() if k != "iter")


def test_update_ratio_is_the_relative_change():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL))
    before = optim.snapshot(model)
    with torch.no_grad():
        model.transformer.h[1].mlp.c_fc.weight.mul_(1.5)  # one matrix of h.1 grows by half
    ratios = optim.update_ratios(model, before)
    w = [p for n, p in zip(dict(model.named_parameters()), before) if n.startswith("transformer.h.1.")]
    fc = model.transformer.h[1].mlp.c_fc.weight
    expected = (0.5 * fc.norm() / 1.5) / torch.sqrt(sum(t.norm() ** 2 for t in w))
    assert ratios["update_ratio/h.1"] == pytest.approx(expected.item(), rel=1e-5)
    assert ratios["update_ratio/h.0"] == 0 and ratios["update_ratio/wte"] == 0


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (dict(optimizer="sgd"), "optimizer='sgd' is not one of 'adamw', 'muon'"),
        (dict(lr_schedule="linear"), "lr_schedule='linear' is not one of 'cosine', 'wsd'"),
        (dict(lr_schedule="wsd", decay_frac=0.0), "decay_frac=0.0 must be in (0, 1]"),
        (dict(lr_schedule="wsd", decay_frac=1.5), "decay_frac=1.5 must be in (0, 1]"),
        (dict(update_ratio_interval=10, parallelism="fsdp"), "update_ratio_interval needs whole weights"),
        (dict(muon_polar_express=True), "muon_polar_express=True is a lever of Muon, which optimizer='adamw'"),
        (dict(optimizer="adamw", muon_cautious_wd=True), "muon_cautious_wd=True is a lever of Muon"),
        (dict(logit_softcap=-1.0), "logit_softcap=-1.0 must be >= 0"),
    ],
)
def test_bad_keys(overrides, expected):
    with pytest.raises(UserError) as e:
        TrainConfig(**overrides)
    assert expected in str(e.value)


def test_bad_input_is_one_line(muon_runs, tmp_path):
    root, data, _ = muon_runs
    result = run_script("train.py", *tiny_args(data, tmp_path / "x"), "--optimizer=adamw", "--muon_normuon=True")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert "muon_normuon=True is a lever of Muon" in result.stderr and not (tmp_path / "x").exists()
    before = (root / "straight" / "metrics.jsonl").read_text()
    result = run_script("train.py", *tiny_args(data, root / "straight"), "--init_from=resume", "--optimizer=adamw")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "trained with optimizer='muon'" in result.stderr
    assert (root / "straight" / "metrics.jsonl").read_text() == before  # nothing written is lost
