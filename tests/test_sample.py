"""Generation: the key/value cache against full recomputation, the sampling controls, and
sample.py's batches, prompts file and streaming."""

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY

import sample
from gpt.data import tokenizer
from gpt.inference.sampling import KVCache, generate, sample_next
from model import GPT, GPTConfig


def tiny_model(seed=0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**TINY)).eval()
    with torch.no_grad():  # weights far from the init, so the next-token distributions are far from flat
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def prompts(B=3, T=5, seed=1):
    return torch.randint(0, 65, (B, T), generator=torch.Generator().manual_seed(seed))


def reference(model, idx, steps, pick, window=None):
    """nanoGPT's loop, written out: run the whole context every step. The context is the
    last block_size tokens or, given window(start, length) -> start, idx[start:]."""
    start = 0
    for _ in range(steps):
        start = window(start, idx.size(1)) if window else max(0, idx.size(1) - model.config.block_size)
        logits, _ = model(idx[:, start:])
        idx = torch.cat([idx, pick(logits[:, -1])], dim=1)
    return idx


greedy = lambda logits: logits.argmax(-1, keepdim=True)

# ---------------------------------------------------------------------------- the cache


def test_cached_step_logits_equal_a_full_forward():
    model = tiny_model()
    idx = prompts(T=6)
    cache = KVCache(model.config, idx.size(0))
    logits, _ = model(idx, cache=cache)  # prefill: causal attention into an empty cache
    for _ in range(9):
        full, _ = model(idx)
        torch.testing.assert_close(logits, full, atol=1e-5, rtol=1e-5)
        idx = torch.cat([idx, greedy(full[:, -1])], dim=1)
        logits, _ = model(idx[:, -1:], cache=cache)  # one new token attending to every cached key
    assert cache.length == 15


def test_a_prompt_longer_than_block_size_is_cropped_the_same_way():
    model = tiny_model()
    idx = prompts(T=40)
    cached = generate(model, idx, 10, temperature=0)
    assert torch.equal(cached[:, :40], idx)
    assert torch.equal(cached, generate(model, idx, 10, temperature=0, kv_cache=False))


@pytest.mark.parametrize("shift", [1, None, 4, 15])
def test_window_shift_slides_the_context_as_documented(shift):
    # when the next token has no position left, the window restarts at the last
    # block_size - shift + 1 tokens, so every context holds between that many and block_size;
    # the default shift is block_size // 8. 60 new tokens after 5: past block_size 16, cached or not
    def window(start, length):
        return length - (16 - (shift or 2) + 1) if length - start > 16 else start

    model = tiny_model()
    idx = prompts()
    # shift 1 keeps the last block_size tokens: nanoGPT's context, token for token
    expected = reference(model, idx, 60, greedy, None if shift == 1 else window)
    assert torch.equal(generate(model, idx, 60, temperature=0, window_shift=shift), expected)
    assert torch.equal(generate(model, idx, 60, temperature=0, window_shift=shift, kv_cache=False), expected)


def test_prefill_equals_the_plain_forward_and_a_full_cache_takes_no_more():
    model = tiny_model()
    idx = prompts(T=16)
    cache = KVCache(model.config, 3)
    cached, _ = model(idx, cache=cache)
    torch.testing.assert_close(cached, model(idx)[0], atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="block_size"):
        model(idx[:, :1], cache=cache)  # position 16 does not exist


# ---------------------------------------------------------------------------- sampling controls


def test_same_seed_same_samples():
    model = tiny_model()
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(generate(model, prompts(), 40, temperature=1.0, top_k=20, top_p=0.9))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


def test_top_p_1_and_no_top_k_is_plain_sampling():
    model = tiny_model()
    plain = lambda logits: torch.multinomial(F.softmax(logits / 0.9, dim=-1), 1)
    torch.manual_seed(3)
    expected = reference(model, prompts(), 40, plain)
    torch.manual_seed(3)
    assert torch.equal(generate(model, prompts(), 40, temperature=0.9, top_k=None, top_p=1.0, window_shift=1), expected)


def test_top_k_1_and_a_tiny_top_p_are_greedy():
    model = tiny_model()
    greedy_out = generate(model, prompts(), 30, temperature=0)
    assert torch.equal(generate(model, prompts(), 30, temperature=1.0, top_k=1), greedy_out)
    # a nucleus of mass 1e-6 holds only the most likely token
    assert torch.equal(generate(model, prompts(), 30, temperature=1.5, top_p=1e-6), greedy_out)


def test_top_p_keeps_the_smallest_set_that_reaches_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().expand(20000, 4)
    torch.manual_seed(0)
    for top_p, support in [(0.4, {1}), (0.75, {1, 3}), (0.85, {1, 2, 3}), (1.0, {0, 1, 2, 3})]:
        drawn = sample_next(logits, top_p=top_p)[:, 0]
        assert set(drawn.tolist()) == support, top_p
    # renormalized inside the nucleus: 0.5 / (0.5 + 0.3)
    drawn = sample_next(logits, top_p=0.75)[:, 0]
    assert abs((drawn == 1).float().mean().item() - 0.625) < 0.02


def test_a_batch_is_the_same_as_single_rows():
    model = tiny_model()
    one = prompts(B=1)
    batch = generate(model, one.repeat(4, 1), 40, temperature=0)
    assert torch.equal(batch, generate(model, one, 40, temperature=0).repeat(4, 1))
    torch.manual_seed(0)
    sampled = generate(model, one.repeat(4, 1), 40, temperature=1.0)
    assert len({tuple(row.tolist()) for row in sampled}) == 4  # each row its own sample, not copies


def test_stop_token_ends_each_row_and_then_the_batch():
    model = tiny_model()
    idx = prompts(B=2)
    free = generate(model, idx, 30, temperature=0)[:, 5:]
    stop = free[0, 3].item()
    first = [row.tolist().index(stop) if stop in row else None for row in free]
    out = generate(model, idx, 30, temperature=0, stop_token=stop)[:, 5:]
    ends = [30 if f is None else f + 1 for f in first]
    assert out.size(1) == max(ends)
    for row, free_row, end in zip(out, free, ends):
        assert torch.equal(row[:end], free_row[:end])
        assert (row[end:] == stop).all()  # a finished row only repeats the stop token


# ---------------------------------------------------------------------------- sample.py


def run_sample(tiny_run, capsys, *args):
    sample.main([f"--out_dir={tiny_run}", "--device=cpu", "--max_new_tokens=40", *args])
    out, err = capsys.readouterr()
    samples = out.split(sample.SEPARATOR + "\n")
    assert samples[0].startswith("loaded ") and samples[-1] == ""
    samples[0] = samples[0].split("\n", 1)[1]
    return samples[:-1], err


@pytest.mark.parametrize(
    "args",
    [["--temperature=0", "--num_samples=1", "--max_new_tokens=60"], ["--num_samples=3", "--top_p=0.9"]],
    ids=["greedy", "sampled"],
)
def test_sample_py_prints_the_same_uncached_and_streamed(tiny_run, capsys, args):
    cached, err = run_sample(tiny_run, capsys, *args)  # not streamed: stdout is not a terminal
    assert "tokens/s" in err and "kv_cache=True" in err
    for other in ("--kv_cache=False", "--stream=True"):
        assert run_sample(tiny_run, capsys, *args, other)[0] == cached, other


def test_sample_py_greedy_batch_rows_agree(tiny_run, capsys):
    samples, err = run_sample(tiny_run, capsys, "--temperature=0", "--num_samples=3", "--start=The king")
    assert len(samples) == 3 and len(set(samples)) == 1 and samples[0].startswith("The king")
    note, timing = err.splitlines()
    assert (
        note == "note: temperature=0 is greedy: the 3 samples of a prompt are one text; --num_samples=1 draws it once"
    )
    assert timing.startswith("120 tokens in ")  # 3 samples x 40 tokens


def test_sample_py_prompts_file(tiny_run, capsys, tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("The king\n\nMy lord\n")
    samples, err = run_sample(tiny_run, capsys, f"--prompts_file={path}", "--num_samples=2")
    assert [s.split(" ")[0] for s in samples] == ["The", "The", "My", "My"]
    assert samples[0] != samples[1]  # two samples of one prompt, not copies
    assert "2 prompt(s) x 2 samples" in err


def test_sample_py_reads_the_checkpoint_on_the_cpu_and_moves_only_the_weights(tiny_run, monkeypatch):
    """The checkpoint also holds the optimizer state (twice the weights for AdamW): it is read into
    host memory, and only the model goes to the device ('meta' stands in for a GPU here)."""
    from gpt.device import runtime
    from gpt.outdir import checkpoint

    map_locations, models = [], []
    real_load, real_load_model = torch.load, checkpoint.load_model
    recorded_load = lambda *a, **k: map_locations.append(k.get("map_location")) or real_load(*a, **k)
    recorded_load_model = lambda *a, **k: models.append(real_load_model(*a, **k)[0]) or (models[0], {})
    monkeypatch.setattr(torch, "load", recorded_load)
    monkeypatch.setattr(checkpoint, "load_model", recorded_load_model)
    monkeypatch.setattr(runtime, "setup", lambda *a, **k: runtime.Runtime("meta", "meta", torch.float32))

    def stop(tok_spec):  # the model is on the device by now; generating on 'meta' could not print anything
        raise InterruptedError

    monkeypatch.setattr(tokenizer, "load", stop)
    with pytest.raises(InterruptedError):
        sample.main([f"--out_dir={tiny_run}"])
    assert map_locations == ["cpu"]
    assert {p.device.type for p in models[0].parameters()} == {"meta"}


def test_stream_holds_back_a_partial_character():
    written = []
    # a token per byte
    stream = tokenizer.TextStream(lambda ids: bytes(ids).decode("utf-8", errors="replace"), written.append)
    data = list("a é!".encode())  # é is two bytes
    for n in range(1, len(data) + 1):
        stream.update(data[:n])
    assert written == ["a", " ", "é", "!"]


def test_an_empty_prompt_starts_a_bpe_model_after_endoftext():
    assert sample.encode_prompt("", lambda text: [], eot=50256, block_size=8) == [50256]
