"""The training data as the loop sees it: a split's token ids (memory-mapped or in RAM), random
training windows from a reproducible generator, the fixed windows every eval scores (and the
consecutive, document-masked ones of the speedruns' val loss: document_windows); and
for chat data (data/chat/prepare.py), rows of whole conversations whose targets are only the
tokens the model is trained to produce (the assistant's).

    data = load_split("data/shakespeare_char", "train")
    batches = TrainBatches(data, batch_size=12, block_size=256, seed=1337, rt=rt)
    x, y = batches()                                   # (B, T) each, on rt.device; y is x shifted by one

    batches = DocumentBatches(data, batch_size=12, block_size=1024, seed=1337, rt=rt, eot=50256, doc_mask=True)
    x, y, docs = batches()                             # rows that start at a document; docs: (B, T) document numbers

    chat = ChatData.open("data/my_chat", "train")
    batches = ChatBatches(chat, batch_size=8, block_size=1024, seed=1337, rt=rt, accum_steps=4)
    x, y, weight = batches()                           # y is -1 where nothing is trained

train.py's: open_splits (train, val and test, checked against block_size and the vocabulary),
for_training (whichever of the three the config asks for) and eval_windows (what every eval scores).
"""

import glob
import os
import re
from collections import deque

import numpy as np
import torch

from configurator import UserError
from gpt.data import token_files, tokenizer
from gpt.device import host_memory
from gpt.device.runtime import to_device


def load_split(data_dir, split, mode="auto", share=1):
    """A split's token ids (gpt/data/token_files.py: one file or many shards, read as one sequence):
    memory-mapped, or read into RAM when mode='ram' or ('auto' and the `share` copies, one per rank
    on this machine, take under a quarter of the memory the job may still use: host_memory.free_memory,
    the host's or its cgroup's limit, the lower). Past that the ranks share the memmap: the page
    cache holds one copy per machine, which the kernel reclaims under pressure instead of killing."""
    data = token_files.Tokens.open(data_dir, split)
    if mode == "memmap":
        return data
    free = host_memory.free_memory()
    if mode == "ram" and free and data.nbytes * share > free:
        mib = lambda n: f"{n / 2**20:,.0f} MiB"
        raise UserError(
            f"data_mode='ram' needs {mib(data.nbytes * share)} for {split} ({share} rank(s) x {mib(data.nbytes)}) "
            f"but this job may use {mib(free)} more (host or cgroup limit); use --data_mode=auto or --data_mode=memmap"
        )
    if mode == "ram" or data.nbytes * share < free / 4:
        data = data.in_ram()  # random windows from RAM avoid page faults on every batch
    return data


def get_batch(data, offsets, block_size, rt, eot=None):
    """Windows starting at `offsets` (B,) -> x, y (B, T) on the device, y = x shifted by one.
    One vectorized gather of (B, T+1) ids and one host-to-device copy. With eot (the end-of-text
    id), also docs (B, T): document_numbers(x)."""
    rows = data[offsets[:, None] + np.arange(block_size + 1)].astype(np.int64)
    if eot is not None:
        docs = document_numbers(rows[:, :-1], eot)
        t = to_device(torch.from_numpy(np.concatenate([rows, docs], axis=1)), rt)
        return t[:, :block_size], t[:, 1 : block_size + 1], t[:, block_size + 1 :]
    t = to_device(torch.from_numpy(rows), rt)
    return t[:, :-1], t[:, 1:]


def document_numbers(x, eot):
    """x (B, T) -> each token's document number in its row (B, T), which goes up by one at every
    end-of-text, so a separator begins the document after it (model.GPT.forward's docs)."""
    return np.cumsum(x == eot, axis=1)


def document_windows(data, offsets, block_size, rt, eot):
    """x, y, docs (B, T) of the windows at `offsets` (B,), as get_batch's with eot, where a window
    may run past the split's end (consecutive windows over a split: the last is short, and a
    window that starts at len(data) is all padding). There the targets are -1 and the inputs
    repeat the split's last token: after every real one, so causal attention keeps them out."""
    index = offsets[:, None] + np.arange(block_size + 1)
    rows = data[np.minimum(index, len(data) - 1)].astype(np.int64)
    x, y = rows[:, :-1], np.where(index[:, 1:] < len(data), rows[:, 1:], IGNORE)
    t = to_device(torch.from_numpy(np.concatenate([x, y, document_numbers(x, eot)], axis=1)), rt)
    return t[:, :block_size], t[:, block_size : 2 * block_size], t[:, 2 * block_size :]


def end_of_text(cfg, tok_spec, data_dir):
    """The token that ends every document (data/corpus.py writes one after each), which
    batch_order='documents', doc_mask and eval_masked find the documents by."""
    keys = f"batch_order={cfg.batch_order!r} doc_mask={cfg.doc_mask} eval_masked={cfg.eval_masked}"
    off = "set batch_order='random', doc_mask=False and eval_masked=False"
    if "chat" in tok_spec:
        raise UserError(f"{keys}: {data_dir} is chat data, whose rows already start at a conversation; {off}")
    eot = tokenizer.eot(tok_spec)
    if eot is None:
        raise UserError(
            f"{keys} needs documents that end with an end-of-text token, and {data_dir} is character-level "
            f"(meta.json), which has none: {off}, or use GPT-2 BPE "
            f"data (python data/shakespeare/prepare.py ends each speech with one)"
        )
    return eot


class TrainBatches:
    """Random training windows from a generator of their own, so the order is reproducible
    and resumable. Every rank draws the whole global batch from the same generator and keeps
    its own slice: ranks see disjoint windows and the state to checkpoint is one value."""

    def __init__(self, data, batch_size, block_size, seed, rt, eot=None):
        self.data, self.batch_size, self.block_size, self.rt = data, batch_size, block_size, rt
        self.eot = eot  # doc_mask: the end-of-text id, and batches carry document numbers (get_batch)
        self.rng = np.random.default_rng(seed)

    def __call__(self):
        B, rank = self.batch_size, self.rt.rank
        offsets = self.rng.integers(0, len(self.data) - self.block_size, size=B * self.rt.world_size)
        return get_batch(self.data, offsets[rank * B : (rank + 1) * B], self.block_size, self.rt, self.eot)

    def state_dict(self):
        """The data position a checkpoint keeps: the generator's state."""
        return self.rng.bit_generator.state

    def load_state_dict(self, state):
        self.rng.bit_generator.state = state


# ---------------------------------------------------------------------------- document-aligned batches


SCAN_CHUNK = 1 << 24  # tokens per step of the separator scan: bounded memory on a memory-mapped split


def separators(data, eot):
    """The positions (int64) of every end-of-text token in a split, found a chunk at a time."""
    return np.concatenate(
        [lo + np.flatnonzero(data[lo : lo + SCAN_CHUNK] == eot) for lo in range(0, len(data), SCAN_CHUNK)]
    ).astype(np.int64)


def row_starts(data, eot, block_size):
    """(where each row of an epoch starts, the number of documents). Every document ends with
    end-of-text (data/corpus.py), so a document's row starts at the separator before it, which
    serves as its beginning-of-sequence token (the split's first document, which has none, at
    token 0). A document longer than a row gets more rows, every block_size tokens after the
    first, so each of its tokens is some row's target. A row runs on into the documents after
    its own and is cut at block_size + 1 tokens; rows that would run past the split's end are
    dropped."""
    seps = separators(data, eot)
    if len(seps) == 0:
        raise UserError(
            f"batch_order='documents' and doc_mask need documents that end with end-of-text (id {eot}), and "
            f"the train split has none: set batch_order='random' and doc_mask=False, or prepare the data again"
        )
    firsts = seps[seps < len(data) - 1]  # a separator begins the document after it
    if int(data[0:1][0]) != eot:
        firsts = np.concatenate([[0], firsts])
    length = np.diff(np.append(firsts, len(data)))  # each document's x positions, its separator included
    rows = -(-length // block_size)  # (n_docs,) rows per document
    within = np.arange(rows.sum()) - np.repeat(np.cumsum(rows) - rows, rows)  # 0, 1, .. in each document
    starts = np.repeat(firsts, rows) + block_size * within
    return starts[starts + block_size + 1 <= len(data)], len(firsts)


class DocumentBatches:
    """Rows that start where a document does (row_starts), in epochs: an epoch visits every row
    start once, in a permutation drawn from (seed, epoch), then the next epoch draws another.
    Every rank takes the next global batch of the permutation and keeps its own slice, so ranks
    see disjoint rows; the state to checkpoint is (seed, epoch, position). doc_mask: batches
    carry each token's document number too (get_batch), and no token attends across documents."""

    def __init__(self, data, batch_size, block_size, seed, rt, eot, doc_mask=False):
        self.data, self.batch_size, self.block_size, self.rt = data, batch_size, block_size, rt
        self.eot, self.doc_mask = eot, doc_mask
        self.starts, self.documents = row_starts(data, eot, block_size)
        if len(self.starts) < batch_size * rt.world_size:
            raise UserError(
                f"the train split's {len(self.starts)} rows of documents are fewer than one global batch "
                f"({rt.world_size} x batch_size={batch_size}): lower batch_size or use batch_order='random'"
            )
        self.seed, self.epoch, self.position = seed, 0, 0
        self.order = self._permutation()

    def _permutation(self):
        return np.random.default_rng([self.seed, self.epoch]).permutation(len(self.starts))

    def __call__(self):
        B, rank, n = self.batch_size, self.rt.rank, self.batch_size * self.rt.world_size
        picked = self.order[self.position : self.position + n]  # (n,) the global batch's rows
        self.position += len(picked)
        if self.position == len(self.order):  # the epoch is over: the next one begins, and tops the batch up
            self.epoch, self.position = self.epoch + 1, n - len(picked)
            self.order = self._permutation()
            picked = np.concatenate([picked, self.order[: self.position]])
        offsets = self.starts[picked[rank * B : (rank + 1) * B]]
        return get_batch(self.data, offsets, self.block_size, self.rt, self.eot if self.doc_mask else None)

    def state_dict(self):
        return {"seed": self.seed, "epoch": self.epoch, "position": self.position, "rows": len(self.starts)}

    def load_state_dict(self, state):
        if state.get("rows") != len(self.starts):
            raise UserError(
                f"cannot resume the document order: the checkpoint's epochs have {state.get('rows')} rows, "
                f"this data and block_size make {len(self.starts)}; resume on the data and block_size it trained with"
            )
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self.order = self._permutation()


def eval_offsets(data, eval_iters, batch_size, block_size, seed):
    """The fixed (eval_iters, B) window starts evaluated at every eval, so curves compare."""
    return np.random.default_rng(seed).integers(0, len(data) - block_size, size=(eval_iters, batch_size))


# ---------------------------------------------------------------------------- chat data


IGNORE = -1  # the target of a position that is not trained (model.forward's ignore_index)


class ChatData:
    """A chat split: the conversations' token ids one after another (gpt/data/token_files.py format),
    mask[i] = 1 where token i is a trained target (the assistant's content and its end-of-turn
    token), and the offset of each conversation's first token."""

    def __init__(self, ids, mask, starts):
        self.ids, self.mask, self.starts = ids, mask, starts
        self.bounds = np.append(starts, len(ids))  # conversation c is ids[bounds[c] : bounds[c + 1]]

    @classmethod
    def open(cls, data_dir, split, mode="auto", share=1):
        ids = load_split(data_dir, split, mode, share)
        arrays = []
        for name in ("mask", "starts"):
            path = os.path.join(data_dir, f"{split}_{name}.npy")
            try:
                arrays.append(np.load(path, mmap_mode="r" if ids.memmapped else None))
            except (OSError, ValueError) as e:
                raise UserError(
                    f"cannot read {path} ({getattr(e, 'strerror', None) or e}): prepare the chat data again "
                    f"with python data/chat/prepare.py"
                )
        mask, starts = arrays
        if (
            len(mask) != len(ids)
            or len(starts) == 0
            or starts[0] != 0
            or np.any(np.diff(starts) <= 0)
            or starts[-1] >= len(ids)
        ):
            raise UserError(
                f"{data_dir}: {split}_mask.npy or {split}_starts.npy does not match {split}'s tokens: "
                f"prepare the chat data again with python data/chat/prepare.py"
            )
        return cls(ids, mask, starts)

    def __len__(self):
        return len(self.ids)

    @property
    def conversations(self):
        return len(self.starts)

    def check_vocab(self, vocab_size):
        self.ids.check_vocab(vocab_size)

    def spans(self, first, block_size):
        """(start, end) token offsets of the rows that start at conversations `first` (see rows)."""
        start = self.starts[first]
        last = np.searchsorted(self.bounds, start + block_size + 1, side="right") - 1  # the last boundary that fits
        end = np.where(last > first, self.bounds[last], np.minimum(start + block_size + 1, len(self.ids)))
        return start, end

    def rows(self, first, block_size):
        """Rows that start at conversations `first` (n,) -> ids (n, T+1) int64, trained (n, T) bool.
        A row holds its first conversation and the ones after it, whole, while they fit in T+1
        tokens; the rest of the row is padding, which trains nothing. A conversation longer than
        T+1 tokens fills the row alone, cut at T+1: its later tokens are never trained."""
        start, end = self.spans(first, block_size)
        index = start[:, None] + np.arange(block_size + 1)
        real = index < end[:, None]
        index = np.where(real, index, start[:, None])  # padding reads a real token; it is never a target
        ids = np.where(real, self.ids[index], 0).astype(np.int64)
        trained = real[:, 1:] & (self.mask[index[:, 1:]] != 0)
        return ids, trained


def chat_batch(ids, trained, rt):
    """Host rows -> x, y (B, T) on the device, y = -1 where nothing is trained."""
    y = np.where(trained, ids[:, 1:], IGNORE)
    t = to_device(torch.from_numpy(np.concatenate([ids[:, :-1], y], axis=1)), rt)
    return t[:, : ids.shape[1] - 1], t[:, ids.shape[1] - 1 :]


class ChatBatches:
    """Random rows of whole conversations, drawn a whole optimizer step at a time (every rank draws
    the global step from the same generator and keeps its own slices, as TrainBatches does).

    The loss of a step is the mean over every trained token of the step, on all micro-batches and
    ranks: not a mean of per-micro-batch means, which would weight a short answer like a long one
    and make the result depend on how the step is split. Each call returns (x, y, weight): the
    micro-batch's summed loss times weight = world_size / (trained tokens in the step) is its
    share (DDP and FSDP average the ranks' gradients, hence world_size)."""

    def __init__(self, data, batch_size, block_size, seed, rt, accum_steps):
        self.data, self.batch_size, self.block_size, self.rt = data, batch_size, block_size, rt
        self.accum_steps = accum_steps
        self.rng = np.random.default_rng(seed)
        self.pending = deque()
        self.step_tokens = 0  # trained tokens in the step drawn last, over all ranks

    def state_dict(self):
        return self.rng.bit_generator.state

    def load_state_dict(self, state):
        self.rng.bit_generator.state = state

    def __call__(self):
        if not self.pending:
            self._draw_step()
        return self.pending.popleft()

    def _draw_step(self):
        B, W, rank = self.batch_size, self.rt.world_size, self.rt.rank
        first = self.rng.integers(0, self.data.conversations, size=(self.accum_steps, W, B))
        ids, trained = self.data.rows(first.reshape(-1), self.block_size)
        self.step_tokens = int(trained.sum())
        weight = W / max(self.step_tokens, 1)
        ids, trained = ids.reshape(self.accum_steps, W, B, -1), trained.reshape(self.accum_steps, W, B, -1)
        for micro in range(self.accum_steps):
            self.pending.append((*chat_batch(ids[micro, rank], trained[micro, rank], self.rt), weight))


def packing(data, block_size, rows=1000, seed=0):
    """(fraction of row positions that are padding, fraction that are trained targets) over
    `rows` random rows: what packing conversations into rows costs."""
    first = np.random.default_rng(seed).integers(0, data.conversations, size=rows)
    start, end = data.spans(first, block_size)
    _, trained = data.rows(first, block_size)
    return 1 - (end - start - 1).mean() / block_size, trained.mean()


# ---------------------------------------------------------------------------- eval batches


def chat_eval_offsets(data, eval_iters, batch_size, seed):
    """The fixed (eval_iters, B) first conversations of the rows every eval scores."""
    return np.random.default_rng(seed).integers(0, data.conversations, size=(eval_iters, batch_size))


def eval_batch(data, offsets, block_size, rt):
    """x, y and the number of trained targets (None: all of them, plain token windows)."""
    if isinstance(data, ChatData):
        ids, trained = data.rows(offsets, block_size)
        return (*chat_batch(ids, trained, rt), int(trained.sum()))
    return (*get_batch(data, offsets, block_size, rt), None)


# ---------------------------------------------------------------------------- a run's data


def open_splits(data_dir, tok_spec, vocab_size, block_size, mode="auto", say=print):
    """{"train", "val", "test"} of data_dir, checked against block_size and the vocabulary: token
    files, or chat data's conversations (data/chat/prepare.py), whose rows start at a
    conversation's start. test is None when the directory has none, or one shorter than block_size."""
    share = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # the ranks on this machine each hold a copy
    if "chat" in tok_spec:
        splits = {name: ChatData.open(data_dir, name, mode, share) for name in ("train", "val")}
        for data in splits.values():
            data.check_vocab(vocab_size)
        padding, trained = packing(splits["train"], block_size)
        say(
            f"chat data: {splits['train'].conversations:,} conversations; rows of block_size={block_size} hold "
            f"whole conversations: {padding:.1%} of positions are padding, {trained:.1%} are trained (assistant) tokens"
        )
        return {**splits, "test": None}
    splits = {name: load_split(data_dir, name, mode, share) for name in ("train", "val")}
    splits["test"] = None
    if glob.glob(os.path.join(glob.escape(data_dir), "test*.bin")):  # optional; scored once, at the end
        splits["test"] = load_split(data_dir, "test", mode, share)
    for name, data in list(splits.items()):
        if data is None:
            continue
        if len(data) <= block_size:
            if name == "test":
                say(f"note: the test split ({len(data)} tokens) is shorter than block_size; it is not evaluated")
                splits[name] = None
                continue
            where = data.paths[0] if len(data.paths) == 1 else re.sub(r"\d{6}(?=\.bin$)", "*", data.paths[0])
            raise UserError(f"block_size={block_size} is longer than {where} ({len(data)} tokens); lower block_size")
        data.check_vocab(vocab_size)  # an id past the embedding table would fail mid-run, or worse on GPU
    return splits


def for_training(data, cfg, rt, accum_steps, eot=None, say=print):
    """The training batches cfg asks for from the train split `data`: chat rows, rows that start
    at a document (batch_order='documents'), or random windows (doc_mask: masked at eot)."""
    if isinstance(data, ChatData):
        return ChatBatches(data, cfg.batch_size, cfg.block_size, cfg.seed, rt, accum_steps)
    if cfg.batch_order == "random":
        return TrainBatches(data, cfg.batch_size, cfg.block_size, cfg.seed, rt, eot if cfg.doc_mask else None)
    batches = DocumentBatches(data, cfg.batch_size, cfg.block_size, cfg.seed, rt, eot, cfg.doc_mask)
    rows = len(batches.starts)
    say(
        f"documents: {batches.documents:,} in train, {rows:,} rows of block_size={cfg.block_size} an epoch "
        f"(~{rows // (cfg.batch_size * cfg.gradient_accumulation_steps):,} iterations)"
    )
    return batches


def eval_windows(splits, eval_iters, batch_size, block_size, seed):
    """{split: (data, offsets)}: the fixed windows (chat data: rows) every eval scores, drawn
    once, with a seed of each split's own."""
    return {
        name: (
            data,
            chat_eval_offsets(data, eval_iters, batch_size, seed + i + 1)
            if isinstance(data, ChatData)
            else eval_offsets(data, eval_iters, batch_size, block_size, seed + i + 1),
        )
        for i, (name, data) in enumerate(splits.items())
        if data is not None
    }
