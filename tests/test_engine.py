"""gpt/inference/engine.py, serve.py's batched engine, against generate() on each prompt alone.
serve.py's HTTP side: test_serve.py."""

import functools
import threading

import pytest
import torch
from conftest import ATEN_BACKEND, concurrently

from gpt.device import cpu_matmuls
from gpt.inference import sampling
from gpt.inference.engine import BatchCache, Engine, Request, compile_options
from model import GPT, GPTConfig

# GPT-2's block, Llama's
SHAPES = [{}, dict(n_kv_head=1, pos_encoding="rope", norm="rmsnorm", mlp="swiglu", bias=False)]


def peaked_model(block_size=64, n_layer=2, **shape):
    """Weights spread far from the init: peaked next-token distributions, so greedy tokens have no near-ties."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_layer=n_layer, n_head=2, n_embd=32, block_size=block_size, **shape)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def replies(engine, prompts, budgets, on_tokens=None, start=False, timeout=300):
    """Greedy requests submitted at once, so that they join at one step: (their tokens, their ends)."""
    outs, ends, done = [[] for _ in prompts], [None] * len(prompts), threading.Semaphore(0)
    with engine.lock:
        for i, (prompt, n) in enumerate(zip(prompts, budgets)):
            on_token = (on_tokens or [None] * len(prompts))[i] or outs[i].append
            on_done = functools.partial(lambda i, *end: (ends.__setitem__(i, end), done.release()), i)
            assert engine.submit(Request(list(prompt), n, on_token, on_done, temperature=0))
    if start:
        engine.start()
    for _ in prompts:
        assert done.acquire(timeout=timeout)
    return outs, ends


def count_eager_passes(model):
    """A compiled step runs its graph, made before this hook, and never calls it."""
    passes = []
    model.register_forward_pre_hook(lambda module, args: passes.append(len(passes)))
    return passes


def token_lists(*lengths):
    return [torch.randint(0, 50, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]


def solo_greedy(model, prompts, budgets):
    return [
        sampling.generate(model, torch.tensor([p]), n, temperature=0)[0, len(p) :].tolist()
        for p, n in zip(prompts, budgets)
    ]


@pytest.mark.parametrize("shape", SHAPES, ids=["gpt2", "llama"])
def test_a_packed_step_gives_each_sequence_its_own_logits(shape):
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


ARRIVALS = {  # id: (prompt lengths, budgets, rows, whether the engine starts before the requests come)
    "joining": ((3, 9, 1, 20, 5, 2, 14), [20, 7, 25, 12, 3, 30, 16], 3, True),
    "prefilled-together": ((12, 1, 19, 7, 3), [9, 15, 6, 20, 11], 8, False),
}


@pytest.mark.parametrize("arrival", ARRIVALS)
@pytest.mark.parametrize("shape", SHAPES, ids=["gpt2", "llama"])
def test_requests_decoded_together_give_solo_greedy_tokens(shape, arrival):
    lengths, budgets, rows, started = ARRIVALS[arrival]
    model, prompts = peaked_model(**shape), token_lists(*lengths)
    solo = solo_greedy(model, prompts, budgets)
    steps = []
    engine = Engine(model, rows=rows, waiting=10, on_step=steps.append)
    outs, ends = replies(engine.start() if started else engine, prompts, budgets, start=not started)
    engine.close()
    assert outs == solo and ends == [("length", n, None) for n in budgets] and engine.held == 0
    assert max(len(step.decoding) + len(step.joining) for step in steps) == min(rows, len(prompts))
    if not started:
        first, later = steps[0], steps[1:]
        assert first.packed and len(first.joining) == 5 and first.tokens == sum(lengths)
        assert not any(step.packed or step.joining for step in later)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["sdpa", "fused"], ids=["gpu-attention", "cpu-attention"])
@pytest.mark.parametrize("shape", SHAPES, ids=["gpt2", "llama"])
def test_a_compiled_engine_gives_solo_greedy_tokens_and_never_recompiles(shape, attention):
    """On ATen's kernels (inductor's: test_compile.py); seven requests whose span of keys grows past 64."""
    from torch._dynamo.utils import counters

    model = peaked_model(block_size=128, n_layer=1, **shape)  # one layer, as below: graphs unroll the layers
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
    outs, _ = replies(engine, prompts, budgets, start=True)
    engine.close()
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
    """As serve.py's model process runs it."""
    model = peaked_model()
    prompts, budgets = token_lists(4, 9, 6), [8, 5, 12]
    solo = solo_greedy(model, prompts, budgets)
    stepped_on, outs = set(), []
    engine = Engine(model, rows=2, on_step=lambda step: stepped_on.add(threading.current_thread()))

    def client():
        try:
            outs.extend(replies(engine, prompts, budgets)[0])
        finally:
            engine.close()

    other = threading.Thread(target=client)
    other.start()
    engine.run()
    other.join()
    assert stepped_on == {threading.current_thread()} and engine.thread.ident is None
    assert outs == solo


def test_on_a_cpu_the_compiled_step_is_inductors_with_the_weights_frozen_and_its_own_matmuls():
    """C++ GEMM kernels for 1-4 rows, oneDNN's past them. One layer: each kernel inductor compiles
    costs seconds on two cores."""
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
    outs, _ = replies(engine, prompts, budgets, start=True)
    engine.close()
    torch._dynamo.reset()
    assert outs == solo and counters["stats"]["unique_graphs"] == 3
    assert len(eager) == sum(step.packed for step in steps) > 0  # the prompts' passes: the decoding steps ran graphs
    assert {step.rows for step in steps if not step.packed} == {1, 2, 4, 8}


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_a_prompt_that_starts_as_an_ended_sequence_runs_only_the_rest(compiled):
    model = peaked_model(block_size=128, n_layer=1)
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
    outs = []
    for group in ([0], [1, 2, 3], [4], [5], [6], [7]):  # a group at a time: each finds the rows the last ones left
        outs += replies(engine, [prompts[i] for i in group], [budgets[i] for i in group])[0]
    engine.close()
    torch.compiler.reset()
    assert outs == solo
    # the next turn holds the first prompt and 6 of its reply
    assert [step.starts for step in steps if step.packed] == [[0], [0, 0, 0], [12 + 6], [3], [0]]
    # the repeat's last token, alone in a decoding step
    assert ([], [11]) in [(step.positions, step.starts) for step in steps if not step.packed]


FORWARD, ALTERNATE, BACKWARD = list(range(8)), [0, 7, 1, 6, 2, 5, 3, 4], list(range(7, -1, -1))
ROUNDS, SLOW = [FORWARD, ALTERNATE, FORWARD, ALTERNATE], pytest.mark.slow


@pytest.mark.parametrize(
    "compiled, rows, orders",
    [
        pytest.param(False, 8, ROUNDS, id="eager-8rows-rounds"),
        pytest.param(False, 5, [BACKWARD] * 4, id="eager-5rows-rounds"),
        pytest.param(False, 8, None, id="eager-8rows-clients"),
        pytest.param(True, 8, ROUNDS, marks=SLOW, id="compiled-8rows-rounds"),
        pytest.param(True, 3, None, marks=SLOW, id="compiled-3rows-clients"),
    ],
)
def test_concurrent_conversations_with_repeats_each_get_their_solo_replies(compiled, rows, orders):
    """Eight two-turn conversations, each turn asked twice: rows end, are kept and reused all the time.
    orders: each round joining in one step in that order; None: a thread per conversation."""
    model = peaked_model(block_size=128, n_layer=1)
    firsts, extra = token_lists(*[3 + 4 * i for i in range(8)]), token_lists(*[1 + i % 5 for i in range(8)])
    budgets = [(5 + 3 * i % 11, 4 + 5 * i % 9) for i in range(8)]
    engine = Engine(model, rows=rows)
    if compiled:
        assert engine.compile(backend=ATEN_BACKEND) is None
    engine.start()
    asked, lock = [], threading.Lock()

    def ask(conversations, turn, earlier=None):
        prompts = [firsts[i] if turn == 0 else firsts[i] + earlier[i] + extra[i] for i in conversations]
        outs, _ = replies(engine, prompts, [budgets[i][turn] for i in conversations])
        with lock:
            asked.extend((prompt, budgets[i][turn], out) for i, prompt, out in zip(conversations, prompts, outs))
        return dict(zip(conversations, outs))

    def conversations(orders):
        first_replies = ask(orders[0], 0)
        ask(orders[1], 0)
        ask(orders[2], 1, first_replies)
        ask(orders[3], 1, first_replies)

    if orders is None:
        concurrently([functools.partial(conversations, [[i]] * 4) for i in range(8)])
    else:
        conversations(orders)
    engine.close()
    torch.compiler.reset()
    assert len(asked) == 32
    wrong = [(prompt, out) for prompt, budget, out in asked if out != solo_greedy(model, [prompt], [budget])[0]]
    assert not wrong, f"{len(wrong)} of 32 replies are not the prompt's own"


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel", ""], ids=["amd", "intel", "unknown"])
def test_eager_matmuls_are_onednns_on_a_cpu_not_intels_with_torchs_logits(vendor):
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
    model, prompt = peaked_model(), [3, 1, 4, 1, 5]
    expected = solo_greedy(model, [prompt], [12])[0]
    engine = Engine(model, rows=2).start()
    calls = []

    def broken(token):  # breaks at its fourth token
        calls.append(token)
        if len(calls) > 3:
            raise RuntimeError("the client's callback broke")

    (_, got), (broken_end, fine_end) = replies(engine, [prompt, prompt], [12, 12], on_tokens=[broken, None])
    engine.close()
    assert broken_end[0] == "error" and "the client's callback broke" in broken_end[2] and len(calls) == 4
    assert fine_end == ("length", 12, None) and got == expected
