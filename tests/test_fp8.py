"""FP8 training (fp8=True, gpt/train/fp8.py) checked on a CPU through torchao's emulation (fp8='emulate':
float8's casts, high-precision matmuls): which layers convert and what they compute, a run that
resumes exactly, a checkpoint of plain weights that samples where torchao cannot be imported, the
Hugging Face and GGUF exports, DDP and FSDP2 under torchrun; and the one-line refusals where
fp8=True cannot run, on a simulated CUDA device. Its speed needs a GPU: docs/fp8.md."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import bpe_eval_data, char_dataset, losses, needs, tiny_args, untimed
from processes import REPO, run_script

from configurator import TrainConfig, UserError, parse
from gpt.outdir import checkpoint
from gpt.train import fp8
from model import GPT, GPTConfig

needs("torchao")

BLOCK_LINEARS = [
    f"transformer.h.{i}.{name}" for i in range(2) for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
]


def tiny_gpt(**options):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=65), **options}))


def is_float8(module):
    return type(module).__name__ == "Float8Linear"


# ---------------------------------------------------------------------------- the conversion


def test_the_blocks_linear_layers_convert_and_the_weights_stay_the_same_tensors():
    model = tiny_gpt()
    params = dict(model.named_parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    converted, kept = fp8.convert(model, "emulate", "lm_head", "cpu")
    assert converted == BLOCK_LINEARS and kept == ["lm_head"]
    assert all(is_float8(model.get_submodule(name)) for name in converted)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.transformer.wte.weight  # still tied
    # the optimizer built after the conversion, and every checkpoint, see the parameters they saw before
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[name] for name, p in model.named_parameters())
    state = model.state_dict()
    assert state.keys() == before.keys()
    assert all(
        type(v) is torch.Tensor and v.dtype == torch.float32 and torch.equal(v, before[k]) for k, v in state.items()
    )


def test_a_converted_layer_computes_with_float8_rounding():
    """Block 0's c_fc against the tensorwise recipe written out with torch's own float8 type: each
    of input and weight scaled so that its absolute maximum lands on e4m3's largest value (448),
    rounded to e4m3, scaled back; then the matmul. A layer left in float32 misses it by far more."""
    model = tiny_gpt()
    layer = model.transformer.h[0].mlp.c_fc
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    fp8.convert(model, "emulate", "lm_head", "cpu")
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(1))

    def e4m3(t):
        scale = torch.finfo(torch.float8_e4m3fn).max / t.abs().max()
        return (t * scale).to(torch.float8_e4m3fn).float() / scale

    with torch.no_grad():
        y = model.transformer.h[0].mlp.c_fc(x)
    reference = e4m3(x) @ e4m3(w).T + b
    assert (y - reference).abs().max() < 1e-6
    assert (y - (x @ w.T + b)).abs().max() > 1e-3  # e4m3 keeps 3 bits of mantissa: the rounding shows


def test_fp8_skip_chooses_the_layers_and_odd_dims_stay():
    model = tiny_gpt(mlp_hidden=40)  # c_fc and c_proj 32 x 40: float8's matmul wants multiples of 16
    converted, kept = fp8.convert(model, "emulate", "", "cpu")
    assert converted == [*(f"transformer.h.{i}.attn.{n}" for i in range(2) for n in ("c_attn", "c_proj")), "lm_head"]
    assert kept == [f"transformer.h.{i}.mlp.{n}" for i in range(2) for n in ("c_fc", "c_proj")]
    assert model.lm_head.weight is model.transformer.wte.weight  # lm_head in float8 keeps the tied matrix

    model = tiny_gpt()
    converted, kept = fp8.convert(model, "emulate", "lm_head, transformer.h.0.", "cpu")
    assert converted == BLOCK_LINEARS[4:] and kept == [*BLOCK_LINEARS[:4], "lm_head"]

    with pytest.raises(
        UserError, match=r"^fp8_skip='lm_hed': no Linear layer's name contains 'lm_hed' .*--fp8_skip=lm_head$"
    ) as e:
        fp8.convert(tiny_gpt(), "emulate", "lm_hed", "cpu")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- where it runs


@pytest.fixture
def gpu(monkeypatch):
    """torch.cuda as a machine with one GPU of the given compute capability and name shows it
    (hip: a ROCm build's version string)."""

    def make(capability, name, hip=None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.version, "hip", hip)

    return make


@pytest.mark.parametrize(
    "capability, name", [((8, 9), "NVIDIA L4"), ((9, 0), "NVIDIA H100 80GB HBM3"), ((10, 0), "NVIDIA B200")]
)
def test_fp8_converts_for_a_gpu_with_fp8_units(gpu, capability, name):
    gpu(capability, name)
    model = tiny_gpt()
    converted, kept = fp8.convert(model, True, "lm_head", "cuda:0")
    assert converted == BLOCK_LINEARS and kept == ["lm_head"]
    assert not model.get_submodule(converted[0]).config.emulate  # the real float8 matmul, torch._scaled_mm


REFUSALS = [
    ("cpu", None, r"fp8=True needs an NVIDIA GPU with FP8 units \(compute capability 8.9\+.*\); this run is on cpu: "),
    (
        "cuda:0",
        ((8, 0), "NVIDIA A100-SXM4-80GB"),
        r"fp8=True needs FP8 units .*; cuda:0 \(NVIDIA A100-SXM4-80GB\) is 8.0: ",
    ),
    ("cuda:0", ((8, 6), "NVIDIA GeForce RTX 3090"), r"; cuda:0 \(NVIDIA GeForce RTX 3090\) is 8.6: "),
    (
        "cuda:0",
        ((9, 4), "AMD Instinct MI300X", "6.2.41133"),
        r"fp8=True is built for NVIDIA's FP8 units .*, not ROCm's: ",
    ),
]


@pytest.mark.parametrize("device, machine, expected", REFUSALS)
def test_fp8_refuses_in_one_line_where_it_cannot_run(gpu, device, machine, expected):
    if machine:
        gpu(*machine)
    model = tiny_gpt()
    with pytest.raises(UserError, match=expected + r"drop --fp8, or set --fp8=emulate .*$") as e:
        fp8.convert(model, True, "lm_head", device)
    assert "\n" not in str(e.value)
    assert not any(is_float8(m) for m in model.modules())  # refused before anything changed
    assert fp8.convert(model, "emulate", "lm_head", device)[0] == BLOCK_LINEARS  # emulation runs there


def test_mps_is_refused_either_way():
    for mode in (True, "emulate"):
        with pytest.raises(
            UserError, match=r"needs float8 tensors, which MPS lacks: .*--fp8=emulate with --device=cpu$"
        ):
            fp8.convert(tiny_gpt(), mode, "lm_head", "mps")


def test_train_py_on_a_cpu_refuses_fp8_true_in_one_line(char_data, tmp_path):
    result = run_script("train.py", *tiny_args(char_data, tmp_path / "out", compile=True, fp8=True))
    assert result.returncode == 2
    assert result.stderr.startswith("error: fp8=True needs an NVIDIA GPU") and result.stderr.count("\n") == 1
    assert not list((tmp_path / "out").glob("ckpt*"))


def test_fp8_keys_are_checked_before_the_run():
    with pytest.raises(
        UserError,
        match=r"^fp8=True needs compile=True: .*; set --compile=True, or --fp8=emulate to check float8's numerics uncompiled$",
    ):
        parse(TrainConfig, ["--fp8=True", "--compile=False"])
    with pytest.raises(UserError, match=r"^fp8=yes \(command line\) is not a valid bool or 'emulate'$"):
        parse(TrainConfig, ["--fp8=yes"])
    assert parse(TrainConfig, ["--fp8=emulate", "--compile=False"]).fp8 == "emulate"


def test_without_torchao_fp8_says_how_to_install_it(monkeypatch):
    for name in ("torchao", "torchao.float8", "torchao.float8.float8_linear"):
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed: import raises ImportError
    with pytest.raises(UserError, match=r"^fp8 needs torchao \(.*\): pip install torchao==0.17.0, or drop --fp8$"):
        fp8.convert(tiny_gpt(), "emulate", "lm_head", "cpu")


# ---------------------------------------------------------------------------- a run in fp8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """root with straight/ (20 steps with fp8='emulate', dropout on), split/ (10 of them, then
    resumed to 20) and data/, GPT-2 BPE tokens, train and val (the GGUF export needs a BPE vocabulary)."""
    root = tmp_path_factory.mktemp("fp8")
    data, _ = bpe_eval_data(root)
    (data / "test.bin").unlink()  # a run's last eval scores test too: the split run's first half would have one more
    common = dict(fp8="emulate", max_iters=20, lr_decay_iters=20, eval_interval=5, dropout=0.1)
    for name, overrides in (("straight", {}), ("split", dict(max_iters=10)), ("split", dict(init_from="resume"))):
        result = run_script("train.py", *tiny_args(data, root / name, **{**common, **overrides}))
        assert result.returncode == 0, result.stderr
        assert "fp8: 8 Linear layers in float8 (emulated" in result.stdout
    return root


def test_an_fp8_run_resumes_exactly(runs):
    """20 steps straight == 10 steps, stop, resume to 20, in fp8 too: each step's scales come from
    the tensors of that step, so there is no float8 state a checkpoint would have to carry."""
    assert untimed(runs / "split") == untimed(runs / "straight")
    a, b = (checkpoint.load(str(runs / name / "ckpt.pt")) for name in ("straight", "split"))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_the_checkpoint_holds_plain_float32_weights_under_plain_names(runs):
    state = checkpoint.load(str(runs / "straight" / "ckpt.pt"))  # torch.load(weights_only=True): no torchao class
    assert state["config"]["fp8"] == "emulate"
    plain = GPT(GPTConfig(**state["model_args"])).state_dict()
    assert state["model"].keys() == plain.keys()
    assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in state["model"].values())


@pytest.mark.process
def test_the_checkpoint_samples_where_torchao_cannot_be_imported(runs):
    """sample.py in a fresh interpreter whose `import torchao` fails, as on a machine without it."""
    blocked = "import runpy, sys; sys.modules['torchao'] = None; sys.argv[0] = 'sample.py'; runpy.run_path('sample.py', run_name='__main__')"
    args = [
        f"--out_dir={runs / 'straight'}",
        "--device=cpu",
        "--num_samples=1",
        "--max_new_tokens=8",
        "--stop_at_eot=False",
        "--start=The",
    ]
    result = subprocess.run(
        [sys.executable, "-c", blocked, *args], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    loaded, sample, _ = result.stdout.split("\n", 2)
    assert loaded.startswith(f"loaded {runs / 'straight' / 'ckpt_best.pt'} (iter 20")
    assert sample.startswith("The") and len(sample) > len("The")  # the prompt and 8 tokens on one line
    assert result.stderr.startswith("8 tokens in")


def test_an_fp8_run_exports_to_hugging_face_and_gguf(runs, tmp_path):
    needs("transformers", "gguf")
    import gguf
    import transformers

    out = runs / "straight"
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


# ---------------------------------------------------------------------------- DDP and FSDP2


@pytest.mark.process
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_two_ranks_in_fp8_train_like_one_process(tmp_path, parallelism):
    """torchrun with 2 CPU ranks (gloo) against one process with the same global batch, both in
    emulated fp8: the same micro-batches, so the same float8 scales. FSDP2 gathers each block's
    float32 weights and Float8Linear casts them in forward (torchao's float8 all-gather is off)."""
    data = char_dataset(tmp_path / "chars")
    common = dict(fp8="emulate", gradient_accumulation_steps=2, max_iters=8, lr_decay_iters=8, eval_interval=4)
    one = run_script("train.py", *tiny_args(data, tmp_path / "one", **common))
    assert one.returncode == 0, one.stderr
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]
    args = tiny_args(data, tmp_path / "two", **common, parallelism=parallelism)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run([*launch, *args], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout.count("fp8: 8 Linear layers in float8") == 1  # rank 0 says it; every rank converts
    a, b = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(a) == len(b) == 8 + 3 * 2
    # float8 turns an ulp into a float8 step: a weight that the ranks' other order of summing moves
    # one ulp across a rounding boundary rounds to the next e4m3 value, 1/8 away. Measured over these
    # 8 steps and 3 evals: 6.4e-4 (DDP) and 3.0e-3 (FSDP2); a run without fp8 is 5.4e-2 away
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-2, json.dumps([a, b])


# ---------------------------------------------------------------------------- the GPU measurement, on a CPU


def test_fp8_bench_runs_both_parts_at_its_cpu_shapes(tmp_path):
    """scripts/fp8_bench.py, the GPU's FP8 measurement (docs/fp8.md), at its CPU shapes with fp8='emulate':
    both sides of each part ran, and the loss curves start from the same init and part as fp8 rounds."""
    result = run_script(
        "scripts/fp8_bench.py", "--device=cpu", f"--out_dir={tmp_path}", "--bench_iters=1", "--bench_warmup=1"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["parts"] == ["speed", "loss"] and report["torchao"] == "0.17.0"
    assert [s["model"] for s in report["speed"]] == ["config/train_llama_tiny.py", "GPT-2's shape, small"]
    for s in report["speed"]:
        assert [r["label"] for r in s["rows"]] == ["fp8=False", "fp8=emulate"] and s["speedup"] > 0
    loss = report["loss"]
    a, b = loss["curves"]["fp8=False"], loss["curves"]["fp8=emulate"]
    assert loss["steps"] == len(a) == len(b) == 8
    assert abs(a[0] - b[0]) < 1e-2 and a != b  # one init and batch; float8's rounding shows from the first step
    assert a[-1] < a[0] - 0.3 and b[-1] < b[0] - 0.3  # both learn the repeating tokens
    assert loss["relative_gap_at_last_step"] == (b[-1] - a[-1]) / a[-1]
    markdown = (tmp_path / "report.md").read_text()
    assert (
        "## Speed: train.py's step without and with fp8" in markdown
        and "## Loss: config/train_llama_tiny.py" in markdown
    )
