"""Compile hygiene on the CPU: training with evals compiles the training graph and eval's no_grad
graph and nothing else, and every model variant compiles as one graph in training and decoding.

Only the Llama test compiles with inductor (on a CPU it builds each fused kernel with g++, ~1 s
each); the others count graphs, recompiles and graph breaks, which dynamo decides before any backend
runs, so they compile with conftest.ATEN_BACKEND. tests/test_gpu.py runs inductor's Triton kernels."""

import itertools

import numpy as np
import pytest
import torch
import torch._inductor.config
from conftest import ATEN_BACKEND, CPU, TINY, TINY_LLAMA
from torch._dynamo.utils import counters

from configurator import TrainConfig
from gpt.data.batches import TrainBatches, eval_offsets
from gpt.inference import sampling
from gpt.train.build import build
from gpt.train.step import eval_group, evaluate, train_step
from model import GPT, GPTConfig

# one block: graphs unroll the blocks, and whether a model is one graph does not hang on how many it has
SHAPE = dict(TINY, n_layer=1, n_head=4, bias=False)
# every Llama option at once: one compile covers them all
LLAMA = dict(TINY_LLAMA, n_layer=1, n_head=4, n_kv_head=2, qk_norm=True)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def test_training_with_evals_compiles_two_graphs_and_never_recompiles(aten_compile):
    keys = dict(device="cpu", compile=True, batch_size=4, block_size=16, n_layer=1, n_head=4, n_embd=32)
    cfg = TrainConfig(**keys, gradient_accumulation_steps=2, eval_iters=3, dropout=0.0)
    torch.manual_seed(0)
    raw_model = GPT(GPTConfig(**SHAPE))
    model, train_model, optimizer, scaler = build(raw_model, cfg, CPU)
    data = np.random.default_rng(0).integers(0, 65, size=4000).astype(np.uint16)
    batches = TrainBatches(data, cfg.batch_size, cfg.block_size, 0, CPU)
    splits = {"val": (data, eval_offsets(data, cfg.eval_iters, cfg.batch_size, cfg.block_size, 1))}
    group = eval_group(cfg, raw_model.config.padded_vocab_size)
    losses = []
    for _ in range(3):
        for _ in range(2):
            losses.append(train_step(train_model, optimizer, scaler, batches, 1e-3, 2, 1.0, CPU).loss)
        evaluate(model, splits, cfg.block_size, CPU, group)
    assert all(torch.isfinite(loss) for loss in losses)
    # one training graph (forward; its backward is compiled with it) and eval's no_grad one
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert sum(counters["recompiles"].values()) <= 1, dict(counters["recompiles"])  # eval's graph is the one recompile
    assert not counters["graph_break"], dict(counters["graph_break"])  # GPT-2 trains and evaluates as one graph each


def test_eval_group_needs_the_fewest_forwards_and_pads_less_than_a_batch_each():
    # every forward has the same shape (step.evaluate tops a rank's last group up with ignored
    # batches): as few forwards as the budget allows, and less than one padded batch each
    for eval_iters, world_size, fits in itertools.product((1, 7, 12, 25, 200), (1, 3, 8), (1, 4, 8)):
        cfg = TrainConfig(batch_size=2, block_size=16, eval_iters=eval_iters)
        group = eval_group(cfg, 64, world_size, budget_bytes=fits * 2 * 16 * 64 * 4)
        per_rank = -(-eval_iters // world_size)
        forwards = -(-per_rank // group)
        assert 1 <= group <= fits and forwards == -(-per_rank // min(fits, per_rank))
        assert forwards * group - per_rank < forwards


@pytest.mark.slow
def test_llama_options_and_checkpointing_train_as_one_graph():
    # one block (LLAMA's): every option is in it, and a second block's kernels cost ~20 more CPU-s of g++
    torch.manual_seed(0)
    model, reference = GPT(GPTConfig(**LLAMA)), GPT(GPTConfig(**LLAMA))
    reference.load_state_dict(model.state_dict())
    model.activation_checkpointing = reference.activation_checkpointing = True
    x = torch.randint(0, 65, (2, 16))
    # scalar C++ kernels (simdlen 1): the same graphs, lowering and fusion, ~14 CPU-s cheaper to build;
    # vec_isa_ok=False spares the program that probes the CPU's vector ISA
    with torch._inductor.config.patch({"cpp.simdlen": 1, "cpp.vec_isa_ok": False}):
        _, loss = torch.compile(model, fullgraph=True, dynamic=False)(x, x)  # inductor; a graph break is an error
        loss.backward()
    _, ref_loss = reference(x, x)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-5)
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5, msg=n)


@pytest.mark.parametrize("options", [dict(SHAPE, bias=True), LLAMA], ids=["gpt2", "llama"])
def test_cached_decoding_is_one_graph(options):
    # as sample.py compiles it: in place, so generate's calls to the model go through it
    torch.manual_seed(0)
    model = GPT(GPTConfig(**options)).eval()
    prompt = torch.randint(0, 65, (1, 4))
    expected = sampling.generate(model, prompt, 3, temperature=0)
    model.compile(fullgraph=True, backend=ATEN_BACKEND)
    assert torch.equal(sampling.generate(model, prompt, 3, temperature=0), expected)
