"""Document-aligned batches (batch_order='documents') and the document mask (doc_mask): rows
that start at a document, each once per epoch and on one rank only, a sampler state that resumes
mid-epoch, a masked row that computes what its documents compute alone, and the speedruns' masked
val loss against a brute force. (train.py's exact resume across an epoch, 2 ranks as 1 and a kill -9
on documents: tests/test_recipes.py, recipe documents.)"""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import CPU, one_line_error, tiny_args
from processes import run_script
from torch.nn.attention.flex_attention import BlockMask

import model as model_module
from configurator import UserError
from gpt.data.batches import DocumentBatches, TrainBatches, row_starts
from gpt.device import runtime
from gpt.evaluation.scoring import masked_loss
from gpt.train.step import train_step
from model import GPT, GPTConfig, document_mask

EOT = 0  # the separator of the counting data below


def counting_documents(n_docs=60, seed=0, longest=40):
    """(data, first): documents of 1..longest tokens, each followed by EOT, as data/corpus.py
    writes them; every other token is its position + 1, so a row tells where it starts.
    first: the position where each document's row starts (its separator before it; 0 for the first)."""
    lengths = np.random.default_rng(seed).integers(1, longest + 1, size=n_docs)
    ends = np.cumsum(lengths + 1) - 1  # where each document's separator is
    data = np.arange(1, ends[-1] + 2, dtype=np.uint32)
    data[ends] = EOT
    return data, np.concatenate([[0], ends[:-1]])


def token_documents(n_docs=60):
    """counting_documents as ids of a 65-token vocabulary (EOT is 64), for a model to read."""
    data, _ = counting_documents(n_docs=n_docs)
    return np.where(data == EOT, 64, data % 63 + 1).astype(np.uint16)


def offsets_of(x):
    """The data offset of each counting-data row (B,): read from its first non-separator token."""
    return np.where(x[:, 0] == EOT, x[:, 1] - 2, x[:, 0] - 1)


def test_rows_start_at_documents_and_continue_inside_long_ones():
    data, first = counting_documents()
    T = 16
    starts, n_docs = row_starts(data, EOT, T)
    expected = []  # a row at each document's start, and every T tokens after it while still inside it
    for b, e in zip(first, list(first[1:]) + [len(data)]):
        expected += [s for s in range(b, e, T) if s + T + 1 <= len(data)]
    assert n_docs == len(first) and starts.tolist() == expected
    assert len(expected) > len(first) - 3  # documents longer than T got more rows than one
    # the sampler's rows are those: a document's separator (or the split's start) first, then the document
    x, y = DocumentBatches(data, 8, T, seed=0, rt=CPU, eot=EOT)()
    assert set(offsets_of(x.numpy())) <= set(expected) and torch.equal(x[:, 1:], y[:, :-1])
    short, short_first = counting_documents(longest=10)
    x, _ = DocumentBatches(short, 8, T, seed=0, rt=CPU, eot=EOT)()
    assert set(offsets_of(x.numpy())) <= set(short_first.tolist())
    assert all(row[0] == EOT or offset == 0 for row, offset in zip(x.tolist(), offsets_of(x.numpy())))


def draw_global(samplers, calls):
    """The rows (offsets) each call gave every rank, rank 0's first: (calls, world_size * B)."""
    return np.stack([np.concatenate([offsets_of(s()[0].numpy()) for s in samplers]) for _ in range(calls)])


def test_an_epoch_draws_every_row_once_split_between_ranks():
    data, _ = counting_documents()
    starts, _ = row_starts(data, EOT, 16)
    rank = lambda r: runtime.Runtime("cpu", "cpu", torch.float32, rank=r, world_size=2)
    ranks = [DocumentBatches(data, 3, 16, seed=4, rt=rank(r), eot=EOT) for r in range(2)]
    calls = 2 * len(starts) // 6 + 2  # past two epochs, with an epoch ending inside a global batch
    drawn = draw_global(ranks, calls)
    assert all(not set(step[:3]) & set(step[3:]) for step in drawn)  # the ranks' rows in a step are disjoint
    order = drawn.reshape(-1)
    epoch1, epoch2 = order[: len(starts)], order[len(starts) : 2 * len(starts)]
    assert sorted(epoch1) == sorted(epoch2) == starts.tolist()  # each row once in each epoch
    assert epoch1.tolist() != epoch2.tolist()  # a new permutation each epoch
    # one rank drawing the whole global batch sees the same order: the data order does not depend on world_size
    single = DocumentBatches(data, 6, 16, seed=4, rt=CPU, eot=EOT)
    assert np.array_equal(draw_global([single], calls), drawn)


def test_the_state_resumes_mid_epoch_exactly():
    data, _ = counting_documents()
    batches = DocumentBatches(data, 4, 16, seed=1, rt=CPU, eot=EOT, doc_mask=True)
    for _ in range(7):
        batches()
    state = json.loads(json.dumps(batches.state_dict()))  # survives a JSON round trip (sharded checkpoints)
    assert state["epoch"] == 0 < state["position"]
    expected = [torch.cat(batches()) for _ in range(30)]  # into the next epochs
    resumed = DocumentBatches(data, 4, 16, seed=999, rt=CPU, eot=EOT, doc_mask=True)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, torch.cat(resumed())) for a in expected)
    with pytest.raises(UserError, match="block_size"):
        DocumentBatches(data, 4, 12, seed=1, rt=CPU, eot=EOT).load_state_dict(state)


def test_random_order_is_the_old_windows():
    """batch_order='random' without doc_mask: the windows the generator has always drawn."""
    data = np.random.default_rng(0).integers(1, 65, size=3000).astype(np.uint16)
    rng, batches = np.random.default_rng(7), TrainBatches(data, 4, 16, seed=7, rt=CPU)
    for x, y in (batches() for _ in range(3)):
        offsets = rng.integers(0, len(data) - 16, size=4)  # the draw TrainBatches has always made
        rows = torch.from_numpy(data[offsets[:, None] + np.arange(17)].astype(np.int64))
        assert torch.equal(x, rows[:, :-1]) and torch.equal(y, rows[:, 1:])


def tiny_gpt(**overrides):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=65, **overrides)).eval()


def test_the_plain_forward_calls_attention_as_before(monkeypatch):
    model, x = tiny_gpt(), torch.randint(1, 65, (2, 32))
    calls = []
    sdpa = F.scaled_dot_product_attention
    spy = lambda *a, **k: calls.append((k["attn_mask"], k["is_causal"])) or sdpa(*a, **k)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    plain, _ = model(x, logits_at="all")
    assert calls == [(None, True)] * 2
    one_doc, _ = model(x, logits_at="all", docs=torch.zeros_like(x))  # one document: the same function, by a mask
    torch.testing.assert_close(one_doc, plain)


class OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: GPT.forward then builds the mask it builds on a GPU."""

    @property
    def is_cuda(self):
        return True


def spy_masks(monkeypatch):
    """The masks GPT.forward builds (model.document_mask's results), as they are built."""
    made = []
    spy = lambda docs, flex: made.append(document_mask(docs, flex)) or made[-1]
    monkeypatch.setattr(model_module, "document_mask", spy)
    return made


@torch.no_grad()  # FlexAttention has no backward on a CPU
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("cuda", [False, True], ids=["cpu", "cuda"])
@pytest.mark.parametrize("pos_encoding", ["learned", "rope"])
def test_a_masked_row_computes_each_document_alone(monkeypatch, cuda, pos_encoding):
    """Rows packed from documents, docs as get_batch makes them: every segment's logits are those
    of the segment run through the model alone. On CUDA the mask is FlexAttention's BlockMask (run
    here on the CPU), elsewhere SDPA's dense boolean mask."""
    model, made = tiny_gpt(pos_encoding=pos_encoding, n_kv_head=2), spy_masks(monkeypatch)
    eot, rng = 64, np.random.default_rng(3)
    rows = [
        [eot, *rng.integers(1, 64, 11), eot, *rng.integers(1, 64, 4), eot, *rng.integers(1, 64, 14)],
        [*rng.integers(1, 64, 20), eot, *rng.integers(1, 64, 11)],
    ]
    x = torch.tensor(rows)
    docs = torch.cumsum(x == eot, dim=1)  # what get_batch gives with eot
    logits, _ = model(x, logits_at="all", docs=docs.as_subclass(OnCuda) if cuda else docs)
    assert len(made) == 1 and isinstance(made[0], BlockMask) == cuda
    for b in range(2):
        for d in docs[b].unique():
            seg = docs[b] == d
            alone, _ = model(x[b][seg][None], logits_at="all")
            torch.testing.assert_close(logits[b][seg].as_subclass(torch.Tensor), alone[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_cuda_training_with_attention_dropout_takes_the_dense_mask(monkeypatch):
    """FlexAttention has no dropout: with dropout on, CUDA's training forward takes SDPA's mask."""
    made, x = spy_masks(monkeypatch), torch.randint(1, 65, (2, 32))
    tiny_gpt(dropout=0.1).train()(x, x, docs=torch.zeros_like(x).as_subclass(OnCuda))
    tiny_gpt(dropout=0.1).eval()(x, x, docs=torch.zeros_like(x).as_subclass(OnCuda))
    assert [isinstance(m, BlockMask) for m in made] == [False, True]


def test_the_flex_mask_is_the_dense_mask():
    docs = torch.tensor([[0] * 5 + [1] * 20 + [2] * 7, [0] * 32])
    flex = document_mask(docs, flex=True)
    assert isinstance(flex, BlockMask)
    b, q, k = torch.meshgrid(torch.arange(2), torch.arange(32), torch.arange(32), indexing="ij")
    assert torch.equal(flex.mask_mod(b, 0, q, k), document_mask(docs)[:, 0])
    assert torch.equal(document_mask(docs)[1, 0], torch.ones(32, 32, dtype=torch.bool).tril())


def test_accumulated_masked_steps_equal_one_big_batch():
    """train_step hands each micro-batch's document numbers to the model: two micro-batches of 2
    rows give the gradient of one of 4."""
    data, grads = token_documents(n_docs=80), []
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for batch_size, accum, doc_mask in ((4, 1, True), (2, 2, True), (4, 1, False)):
        model = tiny_gpt()
        batches = DocumentBatches(data, batch_size, 32, seed=0, rt=CPU, eot=64, doc_mask=doc_mask)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        model.zero_grad()
        grads.append(train_step(model.train(), optimizer, scaler, lambda: batches(), 0.0, accum, 0.0, CPU).grad_norm)
    torch.testing.assert_close(grads[0], grads[1])
    assert not torch.allclose(grads[0], grads[2])  # the document numbers reached the model


@torch.no_grad()
@pytest.mark.parametrize("window", [32, 24])
def test_the_masked_val_loss_is_each_documents_loss_alone(window):
    """masked_loss (the speedruns' val loss) against each window's piece of each document run alone (the
    last window short), the per-token losses averaged. Batches of 3 windows: the last one topped up."""
    data, model, alone, plain = token_documents(n_docs=30), tiny_gpt(pos_encoding="rope"), [], []
    assert (len(data) - 1) % window and -(-(len(data) - 1) // window) % 3  # a short window, a padded batch
    for p in model.parameters():
        p.mul_(4)  # sharper attention: at init the other documents move the mean loss by only ~1e-5
    for start in range(0, len(data) - 1, window):
        piece = torch.from_numpy(data[start : start + window + 1].astype(np.int64))
        x, y, docs = piece[:-1], piece[1:], torch.cumsum(piece[:-1] == 64, 0)  # end-of-text starts the next document
        for d in docs.unique():
            logits, _ = model(x[docs == d][None], logits_at="all")
            alone.append(F.cross_entropy(logits[0], y[docs == d], reduction="none").double())
        plain.append(F.cross_entropy(model(x[None], logits_at="all")[0][0], y, reduction="none").double())
    result = masked_loss(model, data, window, CPU, eot=64, batch_size=3)
    assert result["tokens"] == len(data) - 1 == len(torch.cat(alone))
    assert abs(result["loss"] - torch.cat(alone).mean().item()) < 1e-5
    assert abs(result["loss"] - torch.cat(plain).mean().item()) > 0.05  # the mask changed the loss


# ---------------------------------------------------------------------------- through train.py


@pytest.mark.parametrize("keys", [dict(batch_order="documents"), dict(doc_mask=True)])
def test_character_data_is_refused_in_one_line(char_data, tmp_path, keys):
    result = run_script("train.py", *tiny_args(char_data, tmp_path / "out", **keys))
    one_line_error(result, "end-of-text", "character-level")


def test_compiled_masked_forwards_compile_once():
    """The document numbers are an input like the tokens: new rows, new documents, no new graph."""
    torch._dynamo.reset()  # GPT.forward's compile cache from the worker's earlier files would count against its limit
    model, graphs = tiny_gpt().train(), []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, dynamic=False)
    batches = DocumentBatches(token_documents(), 2, 32, seed=0, rt=CPU, eot=64, doc_mask=True)
    for _ in range(4):
        x, y, docs = batches()
        _, loss = compiled(x, y, docs=docs)
        loss.backward()
    torch._dynamo.reset()
    assert len(graphs) == 1
