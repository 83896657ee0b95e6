"""Supervised fine-tuning on conversations (batches.ChatData, ChatBatches; step.train_step): rows
start at a conversation's start, only the assistant's tokens are targets, and a step's loss is the
mean over all of its trained tokens whatever the micro-batch split, against a hand computation;
fine-tuning a run pretrained here (exact resume and 2 ranks as 1: tests/test_recipes.py, recipe chat)."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import CHAT_VOCAB as VOCAB
from conftest import CPU, chat_arrays, conversations, make_text, tiny_args
from processes import run_script

from data import corpus
from gpt.data.batches import IGNORE, ChatBatches, ChatData, chat_eval_offsets, eval_batch, packing
from gpt.train.step import evaluate, train_step
from model import GPT, GPTConfig


def reference_rows(convs, first, T):
    """A plain re-implementation of the packing rule: whole conversations from `first` on while
    they fit in T+1 tokens, else the first one cut at T+1; -> (ids (T+1,), trained (T,), used)."""
    ids, mask = [], []
    for c in range(first, len(convs)):
        if ids and len(ids) + len(convs[c][0]) > T + 1:
            break
        ids += list(convs[c][0])
        mask += list(convs[c][1])
    ids, mask = ids[: T + 1], mask[: T + 1]
    used = len(ids)
    pad = T + 1 - used
    return np.array(ids + [0] * pad), np.array(mask[1:] + [0] * pad, dtype=bool), used


def test_rows_hold_whole_conversations_from_a_start():
    convs = conversations()
    data = ChatData(*chat_arrays(convs))
    for T in (8, 24, 64):  # shorter than a conversation, about one, several
        first = np.arange(len(convs))
        ids, trained = data.rows(first, T)
        for c in first:
            ref_ids, ref_trained, used = reference_rows(convs, c, T)
            assert np.array_equal(ids[c][:used], ref_ids[:used]) and np.array_equal(trained[c], ref_trained)


def make_model(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=VOCAB, dropout=0.0))


class Keep:
    """An optimizer that never steps or clears: the gradient train_step accumulated stays readable."""

    param_groups = [{"lr": 0.0}]

    def step(self):
        pass

    def zero_grad(self, set_to_none=True):
        pass


def step_gradient(model, data, batch_size, accum_steps, seed=3):
    for p in model.parameters():
        p.grad = None
    batches = ChatBatches(data, batch_size, 32, seed, CPU, accum_steps)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    result = train_step(model, Keep(), scaler, batches, 0.0, accum_steps, 0.0, CPU)
    return result.loss.item(), [p.grad.clone() for p in model.parameters()], batches.step_tokens


def hand_loss(model, data, first, targets_at_untrained=None):
    """Cross entropy over the assistant's tokens of the rows at `first`, from per-token losses
    against the FULL next-token targets; untrained targets replaced by `targets_at_untrained`."""
    ids, trained = data.rows(first, 32)
    x = torch.from_numpy(ids[:, :-1])
    y = torch.from_numpy(ids[:, 1:]).clone()
    if targets_at_untrained is not None:
        y[~torch.from_numpy(trained)] = targets_at_untrained[~torch.from_numpy(trained)]
    logits, _ = model(x, logits_at="all")
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none").reshape(y.shape)
    mask = torch.from_numpy(trained).float()
    return (per_token * mask).sum() / mask.sum()


def test_the_loss_is_cross_entropy_over_the_assistant_tokens_only():
    data = ChatData(*chat_arrays(conversations()))
    model = make_model()
    loss, grads, n = step_gradient(model, data, batch_size=8, accum_steps=1)
    first = np.random.default_rng(3).integers(0, data.conversations, size=(1, 1, 8)).reshape(-1)  # ChatBatches' draw
    assert n == int(data.rows(first, 32)[1].sum()) > 0

    # the system/user tokens' targets play no part: anything in their place (noise), same loss and gradient
    noise = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(9))
    for targets_at_untrained in (None, noise):
        for p in model.parameters():
            p.grad = None
        reference = hand_loss(model, data, first, targets_at_untrained)
        reference.backward()
        assert loss == pytest.approx(reference.item(), rel=1e-6)
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)


def test_gradient_accumulation_does_not_change_the_step():
    # the same 8 rows as 1 x 8 or 4 x 2: with a mean of per-micro-batch means the 4 x 2 step would
    # weigh a micro-batch with few trained tokens like one with many
    data = ChatData(*chat_arrays(conversations()))
    model = make_model()
    loss1, grads1, n1 = step_gradient(model, data, batch_size=8, accum_steps=1)
    loss4, grads4, n4 = step_gradient(model, data, batch_size=2, accum_steps=4)
    assert n1 == n4
    assert loss4 == pytest.approx(loss1, rel=1e-5)
    for a, b in zip(grads1, grads4):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # and the micro-batches really differ in trained tokens, so the test can tell the two rules apart
    first = np.random.default_rng(3).integers(0, data.conversations, size=8)
    per_micro = data.rows(first, 32)[1].reshape(4, 2, -1).sum(axis=(1, 2))
    assert len(set(per_micro.tolist())) > 1


def test_eval_is_the_mean_over_trained_tokens():
    data = ChatData(*chat_arrays(conversations(seed=1)))
    model = make_model().eval()
    offsets = chat_eval_offsets(data, 3, 4, seed=5)
    loss = evaluate(model, {"val": (data, offsets)}, 32, CPU)["val"]
    with torch.no_grad():
        reference = hand_loss(model, data, offsets.reshape(-1))
    assert loss == pytest.approx(reference.item(), rel=1e-5)
    x, y, n = eval_batch(data, offsets.reshape(-1), 32, CPU)
    assert n == int((y != IGNORE).sum())


def test_packing_reports_padding_and_trained_share():
    data = ChatData(*chat_arrays(conversations()))
    padding, trained = packing(data, 32, rows=200)
    first = np.random.default_rng(0).integers(0, data.conversations, size=200)
    used = [reference_rows(conversations(), c, 32)[2] - 1 for c in first]
    assert padding == pytest.approx(1 - np.mean(used) / 32)
    assert 0 < trained < 1 - padding


def test_fine_tuning_starts_from_a_run_pretrained_here(tmp_path):
    """The whole path on one tokenizer: train it, pretrain on plain text, then fine-tune on
    conversations with --init_from=<the pretraining out_dir>. The fine-tuning run starts from that
    run's best weights (max_iters=0 saves the weights it starts from); data tokenized otherwise is
    refused in one line."""
    text = "\n\n".join(make_text(800, seed=s) for s in range(40))
    (tmp_path / "text.txt").write_text(text)
    tokenizer_args = ["--vocab_size=300", f"--out_dir={tmp_path / 'tok'}", "--val_chars=2000"]
    made = run_script("data/train_tokenizer.py", "--input", tmp_path / "text.txt", *tokenizer_args)
    assert made.returncode == 0, made.stderr
    tok = str(tmp_path / "tok" / "tokenizer.json")
    keys = dict(out_dir=tmp_path / "text", tokenizer=tok, txt_separator="\\n\\n", shuffle_buffer=0, val_tokens=2000)
    keys.update(test_tokens=0, workers=1)
    corpus.main(["--input", str(tmp_path / "text.txt"), *(f"--{k}={v}" for k, v in keys.items())])
    pre = run_script("train.py", *tiny_args(tmp_path / "text", tmp_path / "pre", max_iters=10, eval_interval=5))
    assert pre.returncode == 0, pre.stderr

    convs = [
        {"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
        for w in make_text(3000, seed=9).split()
    ]
    (tmp_path / "conv.jsonl").write_text("\n".join(json.dumps(c) for c in convs))
    conv = ["--input", tmp_path / "conv.jsonl", "--block_size=16"]
    prepared = run_script("data/chat/prepare.py", *conv, f"--tokenizer={tok}", f"--out_dir={tmp_path / 'chat'}")
    assert prepared.returncode == 0, prepared.stderr
    sft_args = tiny_args(tmp_path / "chat", tmp_path / "sft", max_iters=0, init_from=tmp_path / "pre")
    sft = run_script("train.py", *sft_args)
    assert sft.returncode == 0, sft.stderr
    assert "come from the weights" in sft.stdout
    best = tmp_path / "pre" / "ckpt_best.pt"
    start = torch.load(best if best.exists() else tmp_path / "pre" / "ckpt.pt", weights_only=True)["model"]
    end = torch.load(tmp_path / "sft" / "ckpt.pt", weights_only=True)
    assert end["tokenizer"]["chat"]["format"] == "role_tokens"
    # every weight as pretrained, but the turn tokens' rows (ids 1-4, reserved by the tokenizer and
    # never seen in plain text), which start as the mean of the others
    turn = [1, 2, 3, 4]
    assert "turn tokens 1, 2, 3, 4 start as the mean" in sft.stdout
    for k, v in start.items():
        if k in ("transformer.wte.weight", "lm_head.weight"):
            others = [i for i in range(v.size(0)) if i not in turn and i < 300]
            assert torch.equal(end["model"][k][others], v[others])
            assert torch.allclose(end["model"][k][turn], v[others].mean(dim=0).expand(4, -1))
        else:
            assert torch.equal(end["model"][k], v)

    gpt2_chat = run_script("data/chat/prepare.py", *conv, f"--out_dir={tmp_path / 'chat2'}")
    assert gpt2_chat.returncode == 0, gpt2_chat.stderr
    refused = run_script("train.py", *tiny_args(tmp_path / "chat2", tmp_path / "sft2", init_from=tmp_path / "pre"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "was trained on data tokenized with" in refused.stderr
    assert "prepare it again with that tokenizer" in refused.stderr
