"""FP8 training (gpt/train/fp8.py) on a CPU through torchao's emulation (fp8='emulate'): which layers
convert and what they compute, and the one-line refusals where fp8=True cannot run, on a simulated
CUDA device. A run in fp8 (resume, 2 ranks, its checkpoint, the exports): tests/test_recipes.py, recipe fp8."""

import json
import sys

import pytest
import torch
import torch.nn as nn
from conftest import TINY, assert_equal_states, needs, tiny_args
from processes import run_script

from configurator import TrainConfig, UserError, parse
from gpt.train import fp8
from model import GPT, GPTConfig

needs("torchao")

MATRICES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
BLOCK_LINEARS = [f"transformer.h.{i}.{name}" for i in range(2) for name in MATRICES]


def tiny_gpt(**options):
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **options}))


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
    assert_equal_states(state, before)
    assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in state.values())


def test_a_converted_layer_computes_with_float8_rounding():
    """Block 0's c_fc against the tensorwise recipe in torch's float8 type: input and weight each scaled
    so that its absolute maximum is e4m3's largest value, rounded to e4m3, scaled back; then the matmul."""
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

    typo = r"^fp8_skip='lm_hed': no Linear layer's name contains 'lm_hed' .*--fp8_skip=lm_head$"
    with pytest.raises(UserError, match=typo) as e:
        fp8.convert(tiny_gpt(), "emulate", "lm_hed", "cpu")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- where it runs


@pytest.fixture
def gpu(monkeypatch):
    """torch.cuda as a machine with one GPU of this compute capability and name (hip: ROCm's version)."""

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


A100, RTX_3090 = ((8, 0), "NVIDIA A100-SXM4-80GB"), ((8, 6), "NVIDIA GeForce RTX 3090")
MI300X = ((9, 4), "AMD Instinct MI300X", "6.2.41133")  # a ROCm build's version
REFUSALS = [
    ("cpu", None, r"fp8=True needs an NVIDIA GPU with FP8 units \(compute capability 8.9\+.*\); this run is on cpu: "),
    ("cuda:0", A100, r"fp8=True needs FP8 units .*; cuda:0 \(NVIDIA A100-SXM4-80GB\) is 8.0: "),
    ("cuda:0", RTX_3090, r"; cuda:0 \(NVIDIA GeForce RTX 3090\) is 8.6: "),
    ("cuda:0", MI300X, r"fp8=True is built for NVIDIA's FP8 units .*, not ROCm's: "),
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
    lacks = r"needs float8 tensors, which MPS lacks: .*--fp8=emulate with --device=cpu$"
    for mode in (True, "emulate"):
        with pytest.raises(UserError, match=lacks):
            fp8.convert(tiny_gpt(), mode, "lm_head", "mps")


def test_train_py_on_a_cpu_refuses_fp8_true_in_one_line(char_data, tmp_path):
    result = run_script("train.py", *tiny_args(char_data, tmp_path / "out", compile=True, fp8=True))
    assert result.returncode == 2
    assert result.stderr.startswith("error: fp8=True needs an NVIDIA GPU") and result.stderr.count("\n") == 1
    assert not list((tmp_path / "out").glob("ckpt*"))


def test_fp8_keys_are_checked_before_the_run():
    uncompiled = r"^fp8=True needs compile=True: .*; set --compile=True, or --fp8=emulate to check float8's numerics"
    with pytest.raises(UserError, match=uncompiled + " uncompiled$"):
        parse(TrainConfig, ["--fp8=True", "--compile=False"])
    with pytest.raises(UserError, match=r"^fp8=yes \(command line\) is not a valid bool or 'emulate'$"):
        parse(TrainConfig, ["--fp8=yes"])
    assert parse(TrainConfig, ["--fp8=emulate", "--compile=False"]).fp8 == "emulate"


def test_without_torchao_fp8_says_how_to_install_it(monkeypatch):
    for name in ("torchao", "torchao.float8", "torchao.float8.float8_linear"):
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed: import raises ImportError
    with pytest.raises(UserError, match=r"^fp8 needs torchao \(.*\): pip install torchao==0.17.0, or drop --fp8$"):
        fp8.convert(tiny_gpt(), "emulate", "lm_head", "cpu")


# ---------------------------------------------------------------------------- the GPU measurement, on a CPU


def test_fp8_bench_runs_both_parts_at_its_cpu_shapes(tmp_path):
    """scripts/fp8_bench.py (docs/fp8.md) at its CPU shapes with fp8='emulate': both sides of each part
    ran, and the loss curves start from the same init and part as fp8 rounds."""
    options = [f"--out_dir={tmp_path}", "--bench_iters=1", "--bench_warmup=0"]  # one timed step each: ran is the point
    result = run_script("scripts/fp8_bench.py", "--device=cpu", *options)
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
    assert "## Speed: train.py's step without and with fp8" in markdown
    assert "## Loss: config/train_llama_tiny.py" in markdown
