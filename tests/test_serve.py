"""serve.py on a loopback port, against real clients: the openai package gets chat.py's and
sample.py's greedy replies; concurrent requests decoded together each get their solo reply, also
one that joins mid-generation; every entry of the error catalogue; a full server's 429; a client
that hangs up; schemathesis from the server's own OpenAPI schema. And gpt/inference/engine.py's batch
against solo generation on the model, GPT-2 and Llama shaped.

The chat model is the chat demo's path (data/chat/synthetic.py, a 512-token tokenizer trained
on it, data/chat/prepare.py, config/chat_demo_cpu.py) trained for 180 steps on 15,000
conversations instead of 1,200 on 60,000, once for the whole test run (conftest's
shared_chat_demo, which test_chat.py and test_gguf.py use too)."""

import contextlib
import functools
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import httpx
import openai
import pytest
import torch
import uvicorn
from conftest import ATEN_BACKEND, chat_demo_copy, train_tiny_run
from processes import REPO, load_script, run_script

import serve
from configurator import UserError, parse
from gpt.data import tokenizer
from gpt.device import cpu_matmuls, runtime
from gpt.inference import api, sampling, serving
from gpt.inference.engine import BatchCache, Engine, Request, compile_options
from model import GPT, GPTConfig
from serve import ServeConfig

KEY = "test-key-123"

# ---------------------------------------------------------------------------- the engine itself

# GPT-2's block, Llama's
SHAPES = [{}, dict(n_kv_head=1, pos_encoding="rope", norm="rmsnorm", mlp="swiglu", bias=False)]


def peaked_model(block_size=64, n_layer=2, **shape):
    """A small GPT (vocab 50, 2 layers, context 64) with weights spread far from the init: peaked
    next-token distributions, so greedy tokens have no near-ties."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_layer=n_layer, n_head=2, n_embd=32, block_size=block_size, **shape)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def greedy_replies(engine, prompts, budgets, timeout=300):
    """Start engine, submit every prompt at once (temperature 0, its budget of tokens), wait for
    them all and close it: each reply's tokens."""
    outs, done = [[] for _ in prompts], threading.Semaphore(0)
    engine.start()
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        assert engine.submit(Request(p, n, outs[i].append, lambda *end: done.release(), temperature=0))
    for _ in prompts:
        assert done.acquire(timeout=timeout)
    engine.close()
    return outs


def count_eager_passes(model):
    """A list that gets an item for each forward pass of model run eagerly from now on. A compiled
    engine's step runs its graph, made before the hook was there (the engine checks only the guards
    that tell its graphs apart), and never calls it; a step that no graph fits runs eagerly and does."""
    passes = []
    model.register_forward_pre_hook(lambda module, args: passes.append(len(passes)))
    return passes


def token_lists(*lengths):
    """A fixed list of token ids (under 50) of each length."""
    return [torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def solo_greedy(model, prompts, budgets):
    """generate()'s greedy new tokens for each prompt alone."""
    return [
        sampling.generate(model, torch.tensor([p]), n, temperature=0)[0, len(p) :].tolist()
        for p, n in zip(prompts, budgets)
    ]


@pytest.mark.parametrize("shape", SHAPES, ids=["gpt2", "llama"])
def test_a_packed_step_gives_each_sequence_its_own_logits(shape):
    """One packed pass that decodes two rows (at positions 6 and 11) and takes in two new prompts
    (4 and 9 tokens) gives each of the four the logits the plain forward gives its own sequence
    alone, and leaves in the cache the keys a later step needs: a second packed pass matches too,
    where three rows decode, row 3 has ended and a prompt that starts with its first 5 tokens takes
    its place running only its own 2 more (reuse), and another prompt joins from position 0.
    Learned positions and RoPE alike."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_layer=2, n_head=4, n_embd=32, block_size=32, **shape)).eval()
    seqs = token_lists(6, 11, 4, 9, 3)

    def alone(seq):  # the last position's logits of the plain forward, no cache
        return model(torch.tensor([seq]))[0][0, -1]

    cache = BatchCache(model.config, rows=5, room=32, dtype=torch.float32, device="cpu")
    with torch.inference_mode():
        # the first two come in as prompts, less their last token
        step = cache.packed(0, [s[:-1] for s in seqs[:2]], [0, 0], "cpu")
        model(torch.tensor([seqs[0][:-1] + seqs[1][:-1]]), cache=step, logits_at=step.last)
        cache.lengths[:2] = [len(s) - 1 for s in seqs[:2]]
        # rows 0 and 1 decode their last token; rows 2 and 3 take in whole prompts
        step = cache.packed(2, seqs[2:4], [0, 0], "cpu")
        logits, _ = model(
            torch.tensor([[seqs[0][-1], seqs[1][-1], *seqs[2], *seqs[3]]]), cache=step, logits_at=step.last
        )
        assert logits.shape == (4, 50)
        for got, seq in zip(logits, seqs[:4]):
            torch.testing.assert_close(got, alone(seq), rtol=1e-5, atol=1e-5)
        cache.lengths[:4] = [len(s) for s in seqs[:4]]
        cache.kept[3] = seqs[3]  # row 3 has ended: what it holds stays there
        again = seqs[3][:5] + [1, 2]
        assert cache.reuse(4, seqs[4]) == 0 and cache.reuse(3, again) == 5  # a prompt that shares nothing: row 4
        nexts = [7, 8, 9]  # rows 0, 1 and 2 decode one more token each
        step = cache.packed(3, [again[5:], seqs[4]], [5, 0], "cpu")
        logits, _ = model(torch.tensor([[*nexts, *again[5:], *seqs[4]]]), cache=step, logits_at=step.last)
        for got, seq in zip(logits, [seqs[0] + [7], seqs[1] + [8], seqs[2] + [9], again, seqs[4]]):
            torch.testing.assert_close(got, alone(seq), rtol=1e-5, atol=1e-5)
        cache.lengths[:5] = [len(seqs[0]) + 1, len(seqs[1]) + 1, len(seqs[2]) + 1, len(again), len(seqs[4])]
        cache.swap(3, 1)  # rows change places, keys and all: row 1 now holds `again`
        step = cache.packed(2, [], [], "cpu")
        logits, _ = model(torch.tensor([[3, 4]]), cache=step, logits_at=step.last)
        for got, seq in zip(logits, [seqs[0] + [7, 3], again + [4]]):
            torch.testing.assert_close(got, alone(seq), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=["gpt2", "llama"])
def test_engine_rows_of_any_length_give_solo_greedy_tokens(shape):
    """Seven requests of different prompt lengths and budgets through an engine of three rows
    (four wait, join as rows free up, rows move when others leave) give, token for token,
    generate()'s greedy tokens for each prompt alone."""
    model = peaked_model(**shape)
    prompts, budgets = token_lists(3, 9, 1, 20, 5, 2, 14), [20, 7, 25, 12, 3, 30, 16]
    solo = solo_greedy(model, prompts, budgets)
    steps = []
    engine = Engine(model, rows=3, waiting=10, on_step=steps.append).start()
    outs, ends, done = [[] for _ in prompts], [None] * len(prompts), threading.Semaphore(0)
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        request = Request(p, n, outs[i].append, lambda *end, i=i: (ends.__setitem__(i, end), done.release()))
        request.temperature = 0
        assert engine.submit(request)
    for _ in prompts:
        assert done.acquire(timeout=60)
    engine.close()
    assert outs == solo and ends == [("length", n, None) for n in budgets]
    assert max(len(step.decoding) + len(step.joining) for step in steps) == 3 and engine.held == 0


@pytest.mark.parametrize("shape", SHAPES, ids=["gpt2", "llama"])
def test_requests_prefilled_together_give_solo_greedy_tokens(shape):
    """Five requests queued before the engine starts are prefilled in one pass, their prompts (1 to
    19 tokens) packed into one sequence, then decoded together: each gets, token for token,
    generate()'s greedy tokens for its prompt alone; every later step is the decoding step."""
    model = peaked_model(**shape)
    prompts, budgets = token_lists(12, 1, 19, 7, 3), [9, 15, 6, 20, 11]
    solo = solo_greedy(model, prompts, budgets)
    steps = []
    engine = Engine(model, rows=8, on_step=steps.append)
    outs, done = [[] for _ in prompts], threading.Semaphore(0)
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        assert engine.submit(Request(p, n, outs[i].append, lambda *end: done.release(), temperature=0))
    engine.start()
    for _ in prompts:
        assert done.acquire(timeout=60)
    engine.close()
    first, later = steps[0], steps[1:]
    assert first.packed and len(first.joining) == 5 and first.tokens == sum(map(len, prompts))
    assert not any(step.packed or step.joining for step in later) and outs == solo


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "fused"], ids=["gpu-attention", "cpu-attention"])
@pytest.mark.parametrize("shape", SHAPES, ids=["gpt2", "llama"])
def test_a_compiled_engine_gives_solo_greedy_tokens_and_never_recompiles(shape, attention):
    """serve.py --compile: the decoding step compiled at start-up, rows padded to a bucket (1, 2, 3 for
    three rows): a graph for one row, one for more. Then seven requests come and go (prompts of 1 to
    20 tokens, replies past 64 positions, so the span of keys grows from one bucket to the next, rows
    moving as others leave) and each gets, token for token, generate()'s greedy tokens of the model
    alone, every decoding step through one of those two graphs (no other compiled, none run
    eagerly). Attention as on a GPU (the model's SDPA, keys padded to 64) and as on a CPU
    (compile_options('cpu'): one_query_attention, keys padded to 16). dynamo's graphs on ATen's
    kernels (conftest): inductor's are test_compile.py's and test_gpu.py's."""
    from torch._dynamo.utils import counters

    model = peaked_model(block_size=128, **shape)
    prompts, budgets = token_lists(3, 9, 1, 20, 5, 2, 14), [20, 7, 25, 12, 3, 70, 16]
    solo = solo_greedy(model, prompts, budgets)
    torch._dynamo.reset()
    counters.clear()
    steps = []
    engine = Engine(model, rows=3, waiting=10, on_step=steps.append)
    cpu = {key: value for key, value in compile_options("cpu").items() if key in ("fused_attention", "key_grain")}
    assert engine.compile(backend=ATEN_BACKEND, **(cpu if attention == "fused" else {})) is None
    assert engine.buckets == [1, 2, 3] and counters["stats"]["unique_graphs"] == 2  # one row; two or three
    eager = count_eager_passes(model)
    outs = greedy_replies(engine, prompts, budgets)
    torch._dynamo.reset()
    assert outs == solo and counters["stats"]["unique_graphs"] == 2
    decoding = [step for step in steps if not step.packed]
    assert len(eager) == len(steps) - len(decoding) > 0  # the prompts' passes: every decoding step ran a graph
    spans = {step.keys for step in decoding}
    if attention == "sdpa":
        assert spans == {64, 128}  # rows up to position 63, then past it
    else:
        assert spans == {16, 32, 48, 64, 80}  # 16 keys at a time, to the longest row's 72 (2 + 70 tokens)
    assert {step.rows for step in decoding} <= set(engine.buckets)


@pytest.mark.slow
def test_run_decodes_on_the_calling_thread_until_another_thread_closes_it():
    """Engine.run, as serve.py's model process runs it: every step on the thread that called it
    (the one that loaded the model), requests submitted from another thread get generate()'s greedy
    tokens, and that thread's close() ends run(), with no thread of the engine's own started."""
    model = peaked_model()
    prompts, budgets = token_lists(4, 9, 6), [8, 5, 12]
    solo = solo_greedy(model, prompts, budgets)
    stepped_on, outs, done = set(), [[] for _ in prompts], threading.Semaphore(0)
    engine = Engine(model, rows=2, on_step=lambda step: stepped_on.add(threading.current_thread()))

    def client():
        for i, (p, n) in enumerate(zip(prompts, budgets)):
            assert engine.submit(Request(p, n, outs[i].append, lambda *end: done.release(), temperature=0))
        for _ in prompts:
            done.acquire(timeout=300)
        engine.close()

    other = threading.Thread(target=client)
    other.start()
    engine.run()
    other.join()
    assert stepped_on == {threading.current_thread()} and engine.thread.ident is None
    assert outs == solo


def test_on_a_cpu_the_compiled_step_is_inductors_with_the_weights_frozen_and_its_own_matmuls():
    """serve.py --compile on a CPU compiles as engine.compile_options('cpu') says, with inductor
    itself: the weights frozen into the graphs, each matmul's packed (the layer's 4 and the lm_head):
    in the graphs of one row and of 2-4 for inductor's C++ GEMM kernels, in the graph of more for
    oneDNN's, as the eager passes (prompts) are. Eight requests, at most eight decoded together, so
    that steps run in each graph as they end one by one: each gets generate()'s greedy tokens of the
    model alone, no step compiling another graph or running eagerly. One layer: each kernel
    inductor compiles costs seconds on two cores."""
    from torch._dynamo.utils import counters

    model = peaked_model(n_layer=1)
    assert cpu_matmuls.onednn_matmuls(model, vendor="AuthenticAMD")  # as serve.py on an AMD CPU: its prompts' passes
    prompts, budgets = token_lists(5, 11, 2, 17, 3, 8, 6, 9), [12, 9, 20, 6, 3, 15, 5, 10]
    solo = solo_greedy(model, prompts, budgets)
    torch._dynamo.reset()
    counters.clear()
    engine = Engine(model, rows=8)
    assert engine.compile(**compile_options("cpu")) is None and engine.buckets == [1, 2, 4, 8]
    assert [(least, most) for least, most, _ in engine.graphs] == [(1, 1), (2, 4), (5, 8)]
    assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] == 3 * (4 + 1)  # every graph
    assert counters["inductor"]["cpp_templated_kernel_counter"] == 2 * (4 + 1)  # one row's and 2-4's
    steps, eager = [], count_eager_passes(model)
    engine.on_step = steps.append
    outs = greedy_replies(engine, prompts, budgets)
    torch._dynamo.reset()
    assert outs == solo and counters["stats"]["unique_graphs"] == 3
    assert len(eager) == sum(step.packed for step in steps) > 0  # the prompts' passes: the decoding steps ran graphs
    assert {step.rows for step in steps if not step.packed} == {1, 2, 4, 8}


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_a_prompt_that_starts_as_an_ended_sequence_runs_only_the_rest(compiled):
    """After the first request has ended, while three others decode together in a bucket of four rows
    (compiled: one of padding, and the row the first left is kept as it was), then one at a time: a
    conversation's next turn (the first turn's prompt and 6 tokens of its reply, then more) runs
    only what follows them; a prompt that shares only the first 3 tokens runs the rest, in a copy
    of them, and the first turn is still kept whole; the first prompt asked again runs only its last
    token (a decoding step); a prompt that shares nothing runs whole. Each gets generate()'s greedy
    tokens alone."""
    model = peaked_model(block_size=128)
    first, others = token_lists(12)[0], token_lists(5, 8, 3)
    reply = solo_greedy(model, [first], [10])[0]
    prompts = [first, *others, first + reply[:6] + [4, 5, 6], first[:3] + [7, 7, 7], list(first), token_lists(7)[0]]
    budgets = [10, 20, 20, 20, 9, 8, 5, 6]
    solo = solo_greedy(model, prompts, budgets)
    steps = []
    engine = Engine(model, rows=4, on_step=steps.append)
    if compiled:
        assert engine.compile(backend=ATEN_BACKEND) is None and engine.buckets == [1, 2, 4]
    engine.start()
    outs = [[] for _ in prompts]
    for group in ([0], [1, 2, 3], [4], [5], [6], [7]):  # a group at a time: each finds the rows the last ones left
        done = threading.Semaphore(0)
        with engine.lock:  # the group's requests join in one step
            for i in group:
                request = Request(prompts[i], budgets[i], outs[i].append, lambda *end: done.release())
                request.temperature = 0
                assert engine.submit(request)
        for _ in group:
            assert done.acquire(timeout=120)
    engine.close()
    torch.compiler.reset()
    assert outs == solo
    # the next turn holds the first prompt and 6 of its reply
    assert [step.starts for step in steps if step.packed] == [[0], [0, 0, 0], [12 + 6], [3], [0]]
    # the repeat's last token, alone in a decoding step
    assert ([], [11]) in [(step.positions, step.starts) for step in steps if not step.packed]


FORWARD, ALTERNATE, BACKWARD = list(range(8)), [0, 7, 1, 6, 2, 5, 3, 4], list(range(7, -1, -1))


@pytest.mark.parametrize(
    "compiled, rows, orders",
    [
        (False, 8, [FORWARD, ALTERNATE, FORWARD, ALTERNATE]),
        (False, 5, [BACKWARD] * 4),
        (False, 8, None),
        pytest.param(True, 8, [FORWARD, ALTERNATE, FORWARD, ALTERNATE], marks=pytest.mark.slow),
        pytest.param(True, 3, None, marks=pytest.mark.slow),
    ],
    ids=[
        "eager-8rows-rounds",
        "eager-5rows-rounds",
        "eager-8rows-clients",
        "compiled-8rows-rounds",
        "compiled-3rows-clients",
    ],
)
def test_concurrent_conversations_with_repeats_each_get_their_solo_replies(compiled, rows, orders):
    """Eight two-turn conversations at once, as chat clients hold them: the first turn, the same turn
    asked again, the second turn (the first prompt, the engine's own reply to it, and more user
    tokens), asked again. Rows end, are kept, and are taken again all the time: a repeat finds its
    prompt, less its last token, at the start of a row that holds its reply too, and gets a copy of
    that start in the row free longest. In rounds (orders: each round's requests join in one step in
    that order of the conversations, `rows` at once, the rest as rows free up) or as clients (None:
    a thread per conversation, each asking again as soon as its reply is done); through an engine
    with a row per conversation and with fewer. Every reply is generate()'s greedy reply to its
    prompt alone."""
    model = peaked_model(block_size=128)
    firsts, extra = token_lists(*[3 + 4 * i for i in range(8)]), token_lists(*[1 + i % 5 for i in range(8)])
    budgets = [(5 + 3 * i % 11, 4 + 5 * i % 9) for i in range(8)]
    engine = Engine(model, rows=rows)
    if compiled:
        assert engine.compile(backend=ATEN_BACKEND) is None
    engine.start()
    asked, lock = [], threading.Lock()

    def ask(conversations, turn, replies=None):
        """The turn's request of each conversation, joining in one step in that order: their replies."""
        prompts = [firsts[i] if turn == 0 else firsts[i] + replies[i] + extra[i] for i in conversations]
        outs, done = [[] for _ in prompts], threading.Semaphore(0)
        with engine.lock:
            for i, prompt, out in zip(conversations, prompts, outs):
                request = Request(prompt, budgets[i][turn], out.append, lambda *end: done.release())
                request.temperature = 0
                assert engine.submit(request)
        for _ in outs:
            assert done.acquire(timeout=120)
        with lock:
            asked.extend((prompt, budgets[i][turn], out) for i, prompt, out in zip(conversations, prompts, outs))
        return dict(zip(conversations, outs))

    def conversations(orders):
        replies = ask(orders[0], 0)
        ask(orders[1], 0)
        ask(orders[2], 1, replies)
        ask(orders[3], 1, replies)

    if orders is None:
        concurrently([functools.partial(conversations, [[i]] * 4) for i in range(8)])
    else:
        conversations(orders)
    engine.close()
    torch.compiler.reset()
    assert len(asked) == 32
    wrong = [(prompt, out) for prompt, budget, out in asked if out != solo_greedy(model, [prompt], [budget])[0]]
    assert not wrong, f"{len(wrong)} of 32 replies are not the prompt's own"


@pytest.mark.slow
def test_a_compile_failure_at_start_up_serves_eagerly_and_says_so(base, base_server, monkeypatch, capsys):
    """serve.py --compile where torch.compile cannot compile (its backend fails, as inductor does
    without a working C++ compiler): one line on stderr says so and what failed, and the server
    answers as the one that never compiled."""

    def broken(graph, example_inputs, **options):
        raise RuntimeError("no working C++ compiler found")

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=broken))
    body = {"model": "", "prompt": "The king", "temperature": 0, "max_tokens": 20}
    auth = {"Authorization": f"Bearer {KEY}"}
    expected = solo(base_server, {**body, "model": base_server.server.name}, "/v1/completions", auth)
    capsys.readouterr()
    steps = []
    with running(f"--out_dir={base}", "--compile=True") as s:
        assert s.engine.buckets is None
        s.engine.on_step = steps.append
        assert solo(s, {**body, "model": s.server.name}, "/v1/completions") == expected
    # the eager step: its own rows, over just the keys they need (compiled: a bucket, 64 keys)
    decoding = [step for step in steps if not step.packed]
    assert len(decoding) == 19 and all(
        step.rows == len(step.decoding) + len(step.joining) and step.keys == max(step.positions + step.starts) + 1
        for step in decoding
    )
    assert [line for line in capsys.readouterr().err.splitlines() if "compile" in line] == [
        "warning: torch.compile of the decoding step failed (RuntimeError: no working C++ compiler found); "
        "serving without it"
    ]


@pytest.mark.slow
def test_on_a_gpu_the_decoding_step_replays_cuda_graphs(base, monkeypatch):
    """The model's side on a CUDA runtime (its weights left on the CPU) compiles the decoding step with
    mode='reduce-overhead' (CUDA graphs), its attention SDPA's and its span of keys padded to 64 for
    them; on the CPU, inductor's C++ wrapper, one_query_attention over keys padded to 16. Both compile
    one graph per bucket of rows at start-up. Recorded at the public torch.compile, which then
    compiles on ATen's kernels."""
    calls, compile = [], torch.compile
    monkeypatch.setattr(
        torch,
        "compile",
        lambda fn, **options: calls.append(options) or compile(fn, dynamic=False, backend=ATEN_BACKEND),
    )
    cfg = parse(ServeConfig, [f"--out_dir={base}", "--compile=True", "--batch_size=2"])
    for rt, expected, attention in [
        (runtime.Runtime("cpu", "cuda", torch.float32), {"dynamic": False, "mode": "reduce-overhead"}, (False, None)),
        (
            runtime.Runtime("cpu", "cpu", torch.float32),
            {"dynamic": False, "options": {"cpp_wrapper": True}},
            (True, 16),
        ),
    ]:
        worker = serving.Worker(cfg, rt, lambda items, stats: None)
        assert calls[-1] == expected and worker.engine.buckets == [1, 2]
        assert (worker.engine.fused_attention, worker.engine.key_grain) == attention
    torch.compiler.reset()


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel", ""], ids=["amd", "intel", "unknown"])
def test_eager_matmuls_are_onednns_on_a_cpu_not_intels_with_torchs_logits(vendor):
    """cpu_matmuls.onednn_matmuls, as serve.py, chat.py and sample.py call it: on a CPU whose vendor is not
    Intel every nn.Linear computes with oneDNN (its parameters and state_dict unchanged), on Intel's (or
    an unknown one) nothing changes. Either way the logits are torch's own F.linear model's to float32
    rounding, and greedy generation is the same, token for token."""
    reference = peaked_model(**SHAPES[1])
    model = peaked_model(**SHAPES[1])
    keys = list(model.state_dict())
    swapped = cpu_matmuls.onednn_matmuls(model, vendor=vendor)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert swapped == (vendor == "AuthenticAMD") and len(linears) == 2 * 4 + 1
    assert all(type(m) is (cpu_matmuls.OneDNNLinear if swapped else torch.nn.Linear) for m in linears)
    assert list(model.state_dict()) == keys
    idx = torch.tensor(token_lists(20))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], reference(idx)[0], rtol=1e-5, atol=1e-5)
    prompt = torch.tensor(token_lists(7))
    expected = sampling.generate(reference, prompt, 30, temperature=0)
    assert torch.equal(sampling.generate(model, prompt, 30, temperature=0), expected)


def test_a_failing_request_ends_alone():
    """A request whose token callback raises ends with finish_reason 'error' and the message; the
    request decoded beside it in the same steps still gets its solo tokens."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_layer=2, n_head=2, n_embd=32, block_size=64)).eval()
    prompt = [3, 1, 4, 1, 5]
    expected = sampling.generate(model, torch.tensor([prompt]), 12, temperature=0)[0, len(prompt) :].tolist()
    engine = Engine(model, rows=2).start()
    got, ends, done = [], {}, threading.Semaphore(0)

    def broken(token):
        if len(got) >= 3:
            raise RuntimeError("the client's callback broke")

    for name, on_token in (("broken", broken), ("fine", got.append)):
        assert engine.submit(
            Request(
                list(prompt),
                12,
                on_token,
                lambda *end, name=name: (ends.__setitem__(name, end), done.release()),
                temperature=0,
            )
        )
    for _ in range(2):
        assert done.acquire(timeout=60)
    engine.close()
    assert ends["broken"][0] == "error" and "the client's callback broke" in ends["broken"][2]
    assert ends["fine"] == ("length", 12, None) and got == expected


# ---------------------------------------------------------------------------- models and servers


@pytest.fixture(scope="module")
def demo(tmp_path_factory, shared_chat_demo):
    """(out_dir, held-out conversations) of a shortened chat demo run (conftest's, copied here)."""
    return chat_demo_copy(shared_chat_demo, tmp_path_factory.mktemp("serve_demo") / "out")


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A character model trained on plain text (no chat template), block_size 64."""
    return train_tiny_run(tmp_path_factory.mktemp("serve_base"), block_size=64, max_iters=30, lr_decay_iters=30)


@contextlib.contextmanager
def running(*args):
    """serve.py's app under uvicorn in a thread, on a free loopback port."""
    server = serving.Server(parse(ServeConfig, ["--device=cpu", "--engine=thread", *args])).start()
    sock = serve.listen("127.0.0.1", 0)  # the command's own socket
    web = uvicorn.Server(uvicorn.Config(api.make_app(server), log_level="warning"))
    thread = threading.Thread(target=web.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not web.started:
        assert thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield types.SimpleNamespace(
            url=f"http://127.0.0.1:{sock.getsockname()[1]}", server=server, engine=server.engine, web=web
        )
    finally:
        web.should_exit = True
        thread.join(10)
        server.close()
        sock.close()


@pytest.fixture(scope="module")
def chat_server(demo):
    with running(f"--out_dir={demo[0]}", "--batch_size=16", "--max_waiting=8") as s:
        yield s


@pytest.fixture(scope="module")
def chat_process(demo):
    """The same server with the model in a process of its own, as `python serve.py` runs it."""
    with running(f"--out_dir={demo[0]}", "--batch_size=16", "--max_waiting=8", "--engine=process") as s:
        yield s


@pytest.fixture(scope="module")
def base_server(base):
    with running(f"--out_dir={base}", f"--api_key={KEY}", "--batch_size=2", "--max_waiting=1", "--max_body=4096") as s:
        yield s


def client(s, key="unused"):
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0)


def chat_py(out_dir, message, max_new_tokens, system=None, sampling=("--temperature=0",)):
    """`chat.py --prompt=message --temperature=0`'s reply (its stdout, without the newline)."""
    result = run_script(
        "chat.py",
        f"--out_dir={out_dir}",
        "--device=cpu",
        f"--prompt={message}",
        *sampling,
        f"--max_new_tokens={max_new_tokens}",
        *([f"--system={system}"] if system else []),
    )
    assert result.returncode == 0 and result.stdout.endswith("\n"), result.stderr
    return result.stdout[:-1]


def sample_py(out_dir, start, max_new_tokens):
    """sample.py's greedy continuation of start."""
    result = run_script(
        "sample.py",
        f"--out_dir={out_dir}",
        "--device=cpu",
        f"--start={start}",
        "--temperature=0",
        "--num_samples=1",
        f"--max_new_tokens={max_new_tokens}",
        "--stream=False",
    )
    assert result.returncode == 0, result.stderr
    loaded, out = result.stdout.split("\n", 1)  # "loaded <checkpoint> ...", then the sample and the separator line
    separator = "\n" + load_script("sample.py").SEPARATOR + "\n"
    assert loaded.startswith("loaded ") and out.startswith(start) and out.endswith(separator), result.stdout
    return out[len(start) : -len(separator)]


def user_messages(heldout, n):
    return [c["messages"][-2]["content"] for c in heldout if len(c["messages"]) == 2][:n]


def chat_bodies(name, messages):
    """A greedy chat request for each user message, of 4, 7, 10, ... tokens at most."""
    return [
        {"model": name, "messages": [{"role": "user", "content": m}], "temperature": 0, "max_tokens": 4 + 3 * i}
        for i, m in enumerate(messages)
    ]


def solo(s, body, path="/v1/chat/completions", headers=None):
    """A request served alone: nothing else is in the engine while it runs."""
    assert not s.server.pending
    r = httpx.post(s.url + path, json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def solo_chat(s, message, max_tokens):
    """The greedy chat reply to one user message, served alone."""
    messages = [{"role": "user", "content": message}]
    return solo(s, {"model": s.server.name, "messages": messages, "temperature": 0, "max_tokens": max_tokens})


# ---------------------------------------------------------------------------- the openai client


@pytest.mark.process
def test_openai_client_gets_chat_py_replies(demo, chat_server, chat_process):
    """chat.completions.create, streamed and not, returns exactly `chat.py --prompt --temperature=0`'s
    reply, with the system message too; usage counts the template's prompt ids, finish_reason says
    whether the reply ended at <|end|> or at max_tokens. Sampled with a seed, it is chat.py's sample
    with that --seed (the request's own generator draws what chat.py's global one does). Both
    servers: the model on a thread of the server's process, and in a process of its own."""
    out_dir, heldout = demo
    cs = [client(chat_server), client(chat_process)]
    template = chat_server.server.template
    cases = [(m, None, 40) for m in user_messages(heldout, 4)] + [
        ("My name is Dovaki.", "Answer briefly.", 40),
        ("Repeat after me: sule pova kire dano", None, 3),
    ]
    reasons = []
    for message, system, n in cases:
        expected = chat_py(out_dir, message, n, system)
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": message}]
        for c in cs:
            reply = c.chat.completions.create(
                model=chat_server.server.name, messages=messages, temperature=0, max_tokens=n
            )
            assert reply.choices[0].message.content == expected, (message, expected)
            assert reply.usage.prompt_tokens == len(template.render(messages, add_generation_prompt=True)[0])
            stream = c.chat.completions.create(
                model=chat_server.server.name,
                messages=messages,
                temperature=0,
                max_completion_tokens=n,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(stream)
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == expected
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == reply.choices[0].finish_reason
            assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
        reasons.append(reply.choices[0].finish_reason)
    assert reasons[-1] == "length" and reasons.count("stop") >= 3, reasons  # the trained replies end by themselves
    greeting = chat_py(out_dir, "Hi, I'm Zuvaki.", 40)  # a stop string: the reply ends before its first match
    stop = greeting[6:9]
    for c, stream in itertools.product(cs, (False, True)):
        reply = c.chat.completions.create(
            model=chat_server.server.name,
            messages=[{"role": "user", "content": "Hi, I'm Zuvaki."}],
            temperature=0,
            stop=["zzz", stop],
            stream=stream,
        )
        chunks = list(reply) if stream else [reply]
        text = (
            "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            if stream
            else reply.choices[0].message.content
        )
        finish_reason = chunks[-1].choices[0].finish_reason
        assert text == greeting[: greeting.index(stop)] and finish_reason == "stop", (greeting, stop, text)
    # sampled: the seed's generator
    for seed, message in [(7, "Hi, I'm Zuvaki."), (11, "Repeat after me: sule pova kire")]:
        expected = chat_py(out_dir, message, 30, sampling=("--temperature=1.5", "--top_p=0.95", f"--seed={seed}"))
        for c in cs:
            reply = c.chat.completions.create(
                model=chat_server.server.name,
                messages=[{"role": "user", "content": message}],
                temperature=1.5,
                top_p=0.95,
                seed=seed,
                max_tokens=30,
            )
            assert reply.choices[0].message.content == expected


@pytest.mark.slow
def test_openai_client_gets_sample_py_continuation(base, base_server):
    """A base model (characters, no chat template): completions.create, streamed and not, gives
    sample.py's greedy continuation; the API key is required."""
    c = client(base_server, KEY)
    for prompt, n in [("The king", 30), ("What is love?\nNow", 45), ("\n", 20)]:
        expected = sample_py(base, prompt, n)
        reply = c.completions.create(model=base_server.server.name, prompt=prompt, temperature=0, max_tokens=n)
        assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "length"
        assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == n
        streamed = c.completions.create(
            model=base_server.server.name, prompt=prompt, temperature=0, max_tokens=n, stream=True
        )
        assert "".join(ch.choices[0].text for ch in streamed) == expected
    with pytest.raises(openai.AuthenticationError):
        client(base_server, "wrong").completions.create(model=base_server.server.name, prompt="The", max_tokens=2)


# ---------------------------------------------------------------------------- batching


@contextlib.contextmanager
def watching(engine, on_step):
    """The engine's on_step hook is on_step until the block ends."""
    engine.on_step = on_step
    try:
        yield
    finally:
        engine.on_step = None


def held_requests(engine, n):
    """Wait until the engine holds n requests (submitted and not done): True, or False after 30 s."""
    with engine.lock:
        return engine.lock.wait_for(lambda: engine.held >= n, timeout=30)


@contextlib.contextmanager
def held(engine, n, opened=None):
    """Keep the engine from taking in prompts until it holds n requests (and the event `opened` is
    set, when given): the requests sent meanwhile are all queued when it goes on. Yields the rows
    (decoding and joining) of each step that ran."""
    rows, released = [], threading.Event()

    def gate(step):
        if step.joining and not released.is_set():
            if held_requests(engine, n) and opened is not None:
                opened.wait(30)
            released.set()  # once open, it stays open
        rows.append(len(step.decoding) + len(step.joining))

    with watching(engine, gate):
        yield rows


class Watch:
    """What the server's event loop has got from the model's side and told it, as it comes: the
    active rows each step's output reports, the requests' ends as (finish_reason, tokens), and the
    ids of the requests submitted and of the cancellations sent."""

    def __init__(self):
        self.active, self.ends, self.submits, self.cancels = [], [], [], []
        self.changed = threading.Condition()

    def wait(self, until):
        """Wait until until() is true, as what comes changes it: True, or False after 30 s."""
        with self.changed:
            return self.changed.wait_for(until, timeout=30)


@contextlib.contextmanager
def watched(server):
    """Yields a Watch of what the server's event loop gets from the model's side (in a process of
    its own or on a thread) and tells it, until the block ends."""
    deliver, tell, seen = server.deliver, server.tell, Watch()

    def watch_deliver(items, stats):
        deliver(items, stats)
        with seen.changed:
            seen.active.append(stats and stats["active"])
            seen.ends.extend(item[1:3] for _, item in items or () if item[0] == "done")
            seen.changed.notify_all()

    def watch_tell(kind, *args):
        told = tell(kind, *args)
        with seen.changed:
            (seen.submits if kind == "submit" else seen.cancels).append(args[0])
            seen.changed.notify_all()
        return told

    server.deliver, server.tell = watch_deliver, watch_tell
    if server.process is not None:
        server.process.deliver = watch_deliver
    try:
        yield seen
    finally:
        server.deliver, server.tell = deliver, tell
        if server.process is not None:
            server.process.deliver = deliver


def concurrently(fns):
    results = [None] * len(fns)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, fns[i]())) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


@pytest.mark.slow
def test_sixteen_concurrent_clients_get_their_solo_replies(demo, chat_server):
    """16 clients at once, different prompts and budgets, at temperature 0 (and three sampled with
    a seed): all 16 are decoded in one batch, rows leave as their replies end, and each reply is
    the one the request gets when served alone."""
    _, heldout = demo
    name = chat_server.server.name
    bodies = chat_bodies(name, user_messages(heldout, 16))
    for i in (2, 7, 11):
        bodies[i].update(temperature=0.9, top_p=0.95, seed=100 + i)
    alone = [solo(chat_server, b) for b in bodies]
    c = client(chat_server)
    with held(chat_server.engine, 16) as rows:
        together = concurrently([lambda b=b: c.chat.completions.create(**b).choices[0].message.content for b in bodies])
    assert together == alone
    assert max(rows) == 16 and rows[-1] < 16  # one batch of all sixteen, which shrank as replies ended


@pytest.mark.slow
def test_a_request_joining_mid_generation_gets_its_solo_reply(demo, chat_server):
    """A long completion is 8 tokens in when a chat request arrives: it is prefilled while the
    first decodes, joins the batch at the next step, and both replies are their solo replies."""
    _, heldout = demo
    name = chat_server.server.name
    # no stop at <|end|>: a long reply
    long = {"model": name, "prompt": "Hi, I'm Zuvaki.", "temperature": 0, "max_tokens": 80}
    late = {
        "model": name,
        "messages": [{"role": "user", "content": user_messages(heldout, 1)[0]}],
        "temperature": 0,
        "max_tokens": 30,
    }
    alone = [solo(chat_server, long, "/v1/completions"), solo(chat_server, late)]
    engine, joins, eighth = chat_server.engine, [], threading.Event()

    def pause(step):
        if step.joining:  # who joins, and who is decoding then (with how many tokens, finished or not)
            joins.append((step.joining, [(r, r.generated, r.finished) for r in step.decoding]))
        if len(joins) == 1 and step.decoding and step.decoding[0].generated >= 8:
            # after the long one's 8th token, no step until the late one is queued
            eighth.set()
            held_requests(engine, 2)

    with watching(engine, pause):
        c = client(chat_server)
        stream = c.completions.create(**long, stream=True)
        assert eighth.wait(30)
        late_reply = c.chat.completions.create(**late).choices[0].message.content
        long_reply = "".join(ch.choices[0].text for ch in stream)
    assert [long_reply, late_reply] == alone
    (long_request,), decoding = joins[0]
    (late_request,), decoding_then = joins[1]
    assert decoding == [] and late_request is not long_request
    # it joined a running batch: the long one, 8 tokens in or more and not finished
    ((request, generated, finished),) = decoding_then
    assert request is long_request and generated >= 8 and finished is None


@pytest.mark.slow
def test_llama3_chat_decoded_together_gets_chat_py_replies(tmp_path):
    """A Llama (RoPE, so every row's keys are rotated at its own positions; grouped-query attention)
    with Llama 3's chat format, weights spread far from the init: four chat requests of different
    lengths decoded in one batch each get `chat.py --temperature=0`'s reply."""
    from test_chat import LLAMA, save_chat_checkpoint
    from test_chat_template import make_llama3_tokenizer

    spec = tokenizer.make_spec(str(make_llama3_tokenizer(tmp_path / "tokenizer.json")))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=spec["vocab_size"], **LLAMA))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    out_dir = save_chat_checkpoint(tmp_path / "out", model, spec)
    messages = ["Hi", "What is the capital of France?", "Reverse: one two three four five six", "東京 🙂"]
    expected = [chat_py(out_dir, m, 12) for m in messages]
    with running(f"--out_dir={out_dir}", "--batch_size=4") as s:
        assert s.server.template.format == "llama3"
        c = client(s)
        with held(s.engine, 4) as rows:
            replies = concurrently(
                [
                    lambda m=m: (
                        c.chat.completions.create(
                            model=s.server.name, temperature=0, max_tokens=12, messages=[{"role": "user", "content": m}]
                        )
                        .choices[0]
                        .message.content
                    )
                    for m in messages
                ]
            )
    assert replies == expected and max(rows) == 4


# ---------------------------------------------------------------------------- the model in its own process


@pytest.mark.process
def test_the_model_in_its_own_process_decodes_together_and_frees_rows(demo, chat_server, chat_process):
    """`serve.py` runs the model in a process of its own (--engine=process, the default): 16
    concurrent clients each get the reply the thread server gives them alone, in steps shared
    by many rows; a client that hangs up has its row cancelled in that process, long before its
    max_tokens; and the server answers alone as before."""
    _, heldout = demo
    s, name = chat_process, chat_process.server.name
    assert s.engine is None and s.server.process.process.is_alive()
    bodies = chat_bodies(name, user_messages(heldout, 16))
    alone = [solo(chat_server, b) for b in bodies]
    c = client(s)
    steps_before = httpx.get(s.url + "/health").json()["steps"]
    with watched(s.server) as seen:
        together = concurrently([lambda b=b: c.chat.completions.create(**b).choices[0].message.content for b in bodies])
    assert together == alone
    tokens, steps = sum(n for _, n in seen.ends), httpx.get(s.url + "/health").json()["steps"] - steps_before
    assert len(seen.ends) == 16 and steps < tokens and max(seen.active) >= 2, (seen.active, seen.ends)
    child = s.server.process.process.pid
    body = {"model": name, "prompt": "Hi, I'm Zuvaki.", "max_tokens": 100, "temperature": 0, "stream": True}
    with watched(s.server) as seen:
        os.kill(child, signal.SIGSTOP)  # no step runs until the hang-up has been sent
        try:
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
                assert r.status_code == 200
            assert seen.wait(lambda: seen.cancels)
        finally:
            os.kill(child, signal.SIGCONT)
        assert seen.wait(lambda: seen.ends)
    ((reason, tokens),) = seen.ends
    assert len(seen.cancels) == 1 and reason == "cancelled" and tokens < 50, (seen.cancels, seen.ends)
    assert httpx.get(s.url + "/health").json()["active"] == 0
    assert solo(s, bodies[0]) == alone[0]


@pytest.mark.process
def test_a_model_process_that_dies_fails_its_requests_and_says_so(base):
    """The model's process killed (out of memory, say) with requests in flight: they, and every
    request after them, /health included, get a 503 saying to restart serve.py; a stream gets it
    as its last event before [DONE]. A loading error in that process is the command's one line."""
    with running(f"--out_dir={base}", "--engine=process") as s:
        child = s.server.process.process.pid
        body = {"model": s.server.name, "prompt": "The", "max_tokens": 20, "temperature": 0}
        assert post(s, "/v1/completions", body)[0].status_code == 200
        os.kill(child, signal.SIGSTOP)
        results = []
        with watched(s.server) as seen:
            thread = threading.Thread(target=lambda: results.append(post(s, "/v1/completions", body)))
            thread.start()
            with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
                assert seen.wait(lambda: len(seen.submits) == 2)
                os.kill(child, signal.SIGKILL)
                events = [line for line in r.iter_lines() if line]
            thread.join(30)
        is_error(results[0][1], 503, results[0][0], "the model's process has stopped (exit code -9); restart serve.py")
        assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["code"] == "engine_stopped"
        for r, payload in [post(s, "/v1/completions", body), (lambda r: (r, r.json()))(httpx.get(s.url + "/health"))]:
            is_error(payload, 503, r, "the model's process has stopped (exit code -9); restart serve.py")
    missing = run_script("serve.py", f"--out_dir={base}/nothing", "--port=0")
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1 and missing.stderr.startswith("error: ")


# ---------------------------------------------------------------------------- errors


def post(s, path, body=None, content=None, headers=None):
    r = httpx.post(s.url + path, json=body, content=content, headers=headers, timeout=30)
    return r, r.json()


def is_error(payload, status, r, *words):
    """OpenAI's error JSON, one line that says what to change."""
    assert r.status_code == status, (r.status_code, payload)
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"} and "\n" not in error["message"]
    assert all(w in error["message"] for w in words), error["message"]
    return error


@pytest.mark.slow
def test_errors_chat(chat_server):
    s, name = chat_server, chat_server.server.name
    hi = [{"role": "user", "content": "Hi"}]
    cases = [  # (body or raw bytes, status, words the message holds, param)
        (b'{"model": "x", "messages": [', 400, ["not valid JSON"], None),  # malformed JSON
        ({"model": name}, 400, ["messages is required"], "messages"),  # a missing field
        ({"model": name, "messages": hi, "temperature": "hot"}, 400, ["temperature"], "temperature"),  # a mistyped one
        (
            {"model": name, "messages": [{"role": "robot", "content": "Hi"}]},
            400,
            ["messages.0.role"],
            "messages.0.role",
        ),
        (
            {"model": name, "messages": [{"role": "user", "content": "sule " * 200}]},
            400,
            ["context of 128 tokens", "shorten it"],
            "messages",
        ),
        (
            {"model": name, "messages": hi, "max_tokens": 500},
            400,
            ["max_tokens=500", "left of the context of 128"],
            "max_tokens",
        ),
        ({"model": "gpt-4o", "messages": hi}, 404, ["'gpt-4o' does not exist", name], "model"),
        ({"model": name, "messages": hi, "n": 2}, 400, ["n=2"], "n"),
        (
            {"model": name, "messages": hi, "tools": [{"type": "function", "function": {"name": "f"}}]},
            400,
            ["tools"],
            "tools",
        ),
        ({"model": name, "messages": hi, "logprobs": True}, 400, ["logprobs"], "logprobs"),
        (
            {"model": name, "messages": hi, "response_format": {"type": "json_object"}},
            400,
            ["response_format"],
            "response_format",
        ),
        ({"model": name, "messages": hi, "frobnicate": 1}, 400, ["unknown field 'frobnicate'"], "frobnicate"),
        ({"model": name, "messages": hi, "stop": ["a", "b", "c", "d", "e"]}, 400, ["at most 4"], "stop"),
        (
            {"model": name, "messages": [{"role": "user", "content": "Hi", "name": "bo"}]},
            400,
            ["name"],
            "messages.0.name",
        ),
        ({"model": name, "messages": hi, "store": True}, 400, ["store"], "store"),
    ]
    for body, status, words, param in cases:
        raw = isinstance(body, bytes)
        r, payload = post(
            s,
            "/v1/chat/completions",
            None if raw else body,
            body if raw else None,
            {"Content-Type": "application/json"} if raw else None,
        )
        assert is_error(payload, status, r, *words)["param"] == param, (body, payload)
    # null: OpenAI's default
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None}
    r, payload = post(s, "/v1/chat/completions", {"model": name, "messages": hi, **nulls, "max_tokens": 3})
    assert r.status_code == 200 and payload["usage"]["completion_tokens"] <= 3
    r, payload = post(
        s, "/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "sule " * 200}]}
    )
    prompt_tokens = len(s.server.template.render([{"role": "user", "content": "sule " * 200}], True)[0])
    assert str(prompt_tokens) in payload["error"]["message"]


@pytest.mark.slow
def test_errors_base(base_server):
    s, name, auth = base_server, base_server.server.name, {"Authorization": f"Bearer {KEY}"}
    r, payload = post(
        s, "/v1/chat/completions", {"model": name, "messages": [{"role": "user", "content": "Hi"}]}, headers=auth
    )
    is_error(payload, 400, r, "no chat template", "/v1/completions", "fine-tune")
    r, payload = post(s, "/v1/completions", {"model": name, "prompt": "Hi"})  # no key
    assert is_error(payload, 401, r, "Authorization: Bearer")["code"] == "invalid_api_key"
    r, payload = post(s, "/v1/completions", {"model": name, "prompt": "Hi"}, headers={"Authorization": "Bearer nope"})
    is_error(payload, 401, r, "API key")
    # Content-Length past 4096
    r, payload = post(s, "/v1/completions", {"model": name, "prompt": "x" * 5000}, headers=auth)
    is_error(payload, 413, r, "limit of 4096")
    chunks = (b'{"model": "%s", "prompt": "' % name.encode(), *[b"x" * 1000] * 5, b'"}')  # no Content-Length: chunked
    r, payload = post(s, "/v1/completions", content=iter(chunks), headers={**auth, "Content-Type": "application/json"})
    is_error(payload, 413, r, "limit of 4096")
    r, payload = post(s, "/v1/completions", {"model": name, "prompt": "The king" * 9}, headers=auth)
    is_error(payload, 400, r, "72 tokens", "context of 64")
    r, payload = post(s, "/v1/completions", {"model": name, "prompt": "The king 東京"}, headers=auth)
    is_error(payload, 400, r, "characters this model never saw")
    assert httpx.get(s.url + "/health").status_code == 200 and httpx.get(s.url + "/v1/models").status_code == 401


@pytest.mark.slow
def test_text_that_is_not_unicode_gets_400(chat_server, base_server):
    """JSON's \\u escapes can spell half a surrogate pair alone (and Python's json takes UTF-8 bytes
    for one): wherever such text is, the request gets a 400 that says so, as do bytes that are not
    UTF-8 at all, and the next request is answered as usual."""
    chat, base, auth = chat_server, base_server, {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    hi = b'[{"role": "user", "content": "Hi"}]'
    cases = [  # (server, path, raw body, param, words)
        (
            chat,
            "/v1/chat/completions",
            b'{"model": "M", "messages": [{"role": "user", "content": "Hi \\ud800"}]}',
            "messages.0.content",
            ["not valid Unicode", "surrogate"],
        ),
        (
            chat,
            "/v1/chat/completions",
            b'{"model": "M", "messages": [{"role": "user", "content": [{"type": "text", "text": "\xed\xa0\x80"}]}]}',
            "messages.0.content.0.text",
            ["not valid Unicode"],
        ),
        (
            chat,
            "/v1/chat/completions",
            b'{"model": "M", "messages": %s, "stop": ["a", "\\udc00"]}' % hi,
            "stop.1",
            ["not valid Unicode"],
        ),
        (
            chat,
            "/v1/chat/completions",
            b'{"model": "M", "messages": %s, "\\ud800": 1}' % hi,
            None,
            ["the body holds text that is not valid Unicode"],
        ),
        (
            chat,
            "/v1/chat/completions",
            b'{"model": "M", "messages": [{"role": "user", "content": "Hi \xff"}]}',
            None,
            ["the body is not valid UTF-8"],
        ),
        (base, "/v1/completions", b'{"model": "M", "prompt": "The \\udfff king"}', "prompt", ["not valid Unicode"]),
        (base, "/v1/completions", b'{"model": "M", "prompt": ["The", "\\ud800"]}', "prompt.1", ["not valid Unicode"]),
        (base, "/v1/completions", b'{"model": "M", "prompt": "The", "stop": "\\ud800"}', "stop", ["not valid Unicode"]),
    ]
    for s, path, body, param, words in cases:
        r, payload = post(s, path, content=body.replace(b'"M"', b'"%s"' % s.server.name.encode()), headers=auth)
        assert is_error(payload, 400, r, *words)["param"] == param, (body, payload)
        if s is chat:
            assert solo(s, {"model": s.server.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        else:
            assert solo(s, {"model": s.server.name, "prompt": "The", "max_tokens": 3}, "/v1/completions", auth)


@pytest.mark.slow
def test_a_host_header_naming_another_host_gets_421(base, chat_server):
    """DNS rebinding: a page on attacker.example that points its name at 127.0.0.1 reaches the
    server, but its requests say Host: attacker.example, and get OpenAI's error JSON with a 421
    on every endpoint; 127.0.0.1, localhost and [::1] are answered, and no CORS header lets a
    page elsewhere read a reply; nor is another IP address. On 0.0.0.0 IP addresses are answered
    and --allowed_hosts adds names; a name that is not a host name is one line at the start."""
    s = chat_server
    port, name = s.url.rsplit(":", 1)[1], s.server.name
    chat = {"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    requests = [
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/completions", {"model": name, "prompt": "Hi", "max_tokens": 3}),
        ("GET", "/v1/models", None),
        ("GET", "/", None),
    ]
    for method, path, body in requests:
        r = httpx.request(method, s.url + path, json=body, headers={"Host": f"attacker.example:{port}"}, timeout=30)
        error = is_error(
            r.json(), 421, r, f"Host 'attacker.example:{port}'", "DNS rebinding", "--allowed_hosts=attacker.example"
        )
        assert error["code"] == "host_not_allowed" and error["type"] == "invalid_request_error"
        r = httpx.request(method, s.url + path, json=body, headers={"Host": f"10.0.0.5:{port}"}, timeout=30)
        assert r.status_code == 421, r.text  # on loopback, not even another IP address
        for host in ("localhost", "127.0.0.1", "[::1]", "127.3.2.1"):
            r = httpx.request(
                method,
                s.url + path,
                json=body,
                headers={"Host": f"{host}:{port}", "Origin": "http://attacker.example"},
                timeout=30,
            )
            cors = [h for h in r.headers if h.startswith("access-control-")]
            assert r.status_code == 200 and not cors, (host, path, r.text)
    with running(f"--out_dir={base}", "--host=0.0.0.0", "--allowed_hosts=serve.example, Box.LAN") as s:
        port, body = s.url.rsplit(":", 1)[1], {"model": s.server.name, "prompt": "The", "max_tokens": 3}
        for host, status in [
            ("serve.example", 200),
            ("box.lan.", 200),
            ("BOX.lan", 200),
            ("192.168.1.7", 200),
            ("localhost", 200),
            ("attacker.example", 421),
            ("lan", 421),
            ("serve.example.attacker.example", 421),
        ]:
            r = httpx.post(s.url + "/v1/completions", json=body, headers={"Host": f"{host}:{port}"}, timeout=30)
            assert r.status_code == status, (host, r.text)
    with pytest.raises(UserError, match="allowed_hosts: 'http://box.lan' is not a host name"):
        parse(ServeConfig, ["--allowed_hosts=box.lan,http://box.lan"])


@pytest.mark.slow
def test_connections_send_without_nagle(base_server):
    """The server's side of an accepted connection has TCP_NODELAY set: without it each streamed
    chunk after the first waits for the client's delayed ACK (about 40 ms on Linux) before it leaves."""
    s = base_server
    with httpx.Client(base_url=s.url) as http:  # keeps its connection open after the response
        assert http.get("/health").status_code == 200
        sockets = [c.transport.get_extra_info("socket") for c in list(s.web.server_state.connections)]
        assert sockets and all(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for sock in sockets)


@pytest.mark.slow
def test_a_full_server_answers_429_at_once(base, base_server):
    """Two rows and one waiting place: a fourth request gets 429 with Retry-After at once, and the
    three accepted get sample.py's continuations when the engine goes on."""
    s, name = base_server, base_server.server.name
    c = client(s, KEY)
    prompts = ["The king", "What is", "Now my lord"]
    expected = [sample_py(base, p, 20) for p in prompts]
    refused = threading.Event()
    with held(s.engine, 3, opened=refused):
        calls = [
            lambda p=p: c.completions.create(model=name, prompt=p, temperature=0, max_tokens=20).choices[0].text
            for p in prompts
        ]
        results = [None]
        thread = threading.Thread(target=lambda: results.__setitem__(0, concurrently(calls)))
        thread.start()
        assert held_requests(s.engine, 3)
        t0 = time.monotonic()
        r, payload = post(
            s,
            "/v1/completions",
            {"model": name, "prompt": "The", "max_tokens": 2},
            headers={"Authorization": f"Bearer {KEY}"},
        )
        waited = time.monotonic() - t0
        refused.set()
        thread.join(60)
    assert is_error(payload, 429, r, "full")["code"] == "server_busy" and r.headers["Retry-After"] == "1"
    assert waited < 5  # answered while the others were still held, not after them
    assert results[0] == expected


@pytest.mark.slow
def test_a_client_that_hangs_up_frees_its_row_at_once(demo, chat_server):
    """A stream dropped after three chunks: its row is freed before the next step (cancelled, far
    from its 100 tokens: the engine waits for the hang-up after 20), and the server answers the
    next request as before."""
    out_dir, _ = demo
    s, engine = chat_server, chat_server.engine
    body = {"model": s.server.name, "prompt": "Hi, I'm Zuvaki.", "max_tokens": 100, "temperature": 0, "stream": True}
    with watched(s.server) as seen:

        def pause(step):  # after 20 tokens, no step until the hang-up is told: the reply cannot finish meanwhile
            if step.decoding and step.decoding[0].generated == 20:
                seen.wait(lambda: seen.cancels)

        with watching(engine, pause):
            with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()
                # three events and their blank lines
                events = [next(lines) for _ in range(6)][::2]
                assert all(event.startswith("data: ") for event in events) and engine.stats()["active"] == 1
            assert seen.wait(lambda: seen.ends)
    assert httpx.get(s.url + "/health").json()["active"] == 0
    # freed at the step after the hang-up at the latest
    ((reason, tokens),) = seen.ends
    assert reason == "cancelled" and tokens <= 21 and len(seen.cancels) == 1, seen.ends
    message = "Repeat after me: sule pova"
    assert solo_chat(s, message, 20) == chat_py(out_dir, message, 20)


@pytest.mark.process
def test_the_command_warns_when_it_listens_beyond_loopback_with_no_key(base):
    """`python serve.py` in its own process: by default on 127.0.0.1; --host=0.0.0.0 without a key
    says on stderr who can then use the model, serves, and ends on Ctrl-C without a traceback; a
    taken port is one line."""
    assert parse(ServeConfig, []).host == "127.0.0.1"
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "serve.py", f"--out_dir={base}", "--device=cpu", "--host=0.0.0.0", f"--port={port}"],
        cwd=REPO,
        env={**os.environ, "OPENAI_API_KEY": ""},  # '': no key
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = [proc.stderr.readline() for _ in range(2)]  # as serve.py writes them
        assert lines[0].startswith("warning: listening on 0.0.0.0 with no API key: anyone who can reach this machine")
        assert lines[1].startswith("serving out (completions only") and f":{port}/" in lines[1]
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "out", "prompt": "The", "max_tokens": 3},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        taken = run_script("serve.py", f"--out_dir={base}", f"--port={port}", "--host=0.0.0.0")
        assert taken.returncode == 2 and taken.stderr.startswith(f"error: cannot listen on 0.0.0.0:{port}")
        assert len(taken.stderr.splitlines()) == 1
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down, then Ctrl-C ends the command as any other here
        rest = proc.communicate(timeout=30)[1]
    assert proc.returncode == 130 and rest == "interrupted\n"


# ---------------------------------------------------------------------------- fuzzing


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(demo, chat_server):
    """Cases generated from the server's own OpenAPI schema, valid and invalid: never a 5xx, every
    4xx in OpenAI's error shape, and afterwards the server still gives chat.py's reply."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    s = chat_server
    schema = schemathesis.openapi.from_url(s.url + "/openapi.json")
    statuses = []
    for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

        @given(case=schema.as_strategy(generation_mode=mode))
        @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def fuzz(case):
            response = case.call(base_url=s.url, timeout=60)
            statuses.append(response.status_code)
            assert response.status_code < 500, (case.path, case.body, response.text)
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text

        fuzz()
    assert 200 in statuses and 400 in statuses and s.engine.held == 0
    out_dir, heldout = demo
    message = user_messages(heldout, 1)[0]
    assert solo_chat(s, message, 30) == chat_py(out_dir, message, 30)
