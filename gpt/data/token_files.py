"""Token files: one format for every dataset, and a split read as one sequence over its shards.

A token file is a 32-byte little-endian header, then the token ids:
    magic   8 bytes  b"GPTTOKEN"
    version uint32   1
    width   uint32   bytes per token id: 2 (uint16, vocabularies up to 65,536) or 4 (uint32)
    count   uint64   number of token ids that follow
    max_id  uint64   the largest id in the file
The count makes a truncated file (an interrupted write, a partial copy) detectable; max_id
lets the trainer check the ids against its vocabulary without reading billions of them.
llm.c's files (the speedruns' FineWeb shards) load as they are: 256 little-endian int32
(magic 20240520, version 1, the token count, then zeros), then uint16 ids. Files with neither
magic are nanoGPT's headerless uint16 .bin files and load as before.

A split is `<split>.bin`, or shards `<split>_000000.bin`, `<split>_000001.bin`, ... read in
order as one sequence; a window may cross from one shard into the next. In a folder of llm.c's
shards a split is `<name>_<split>_NNNNNN.bin`, numbered on from where it starts: the
speedruns' fineweb_train_000001.bin, fineweb_train_000002.bin, ... and fineweb_val_000000.bin.
"""

import glob
import os
import re
import struct

import numpy as np

from configurator import UserError

MAGIC = b"GPTTOKEN"
VERSION = 1
HEADER = struct.Struct("<8sIIQQ")  # magic, version, width, count, max_id
DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}
LLMC_MAGIC, LLMC_VERSION = struct.pack("<i", 20240520), 1
LLMC_HEADER = 256 * 4  # bytes: 256 int32, of which magic, version and the token count are set
CHECK_CHUNK = 1 << 24  # tokens per step of the vocabulary check: bounded memory on a memmapped split


def dtype_for(vocab_size):
    """The narrowest token dtype that holds every id below vocab_size."""
    return DTYPES[2] if vocab_size <= 1 << 16 else DTYPES[4]


def write(path, tokens):
    """Write a token file atomically: to path.tmp, fsynced, then renamed, so a file under its
    final name is always complete."""
    tokens = np.asarray(tokens)
    dtype = DTYPES.get(tokens.dtype.itemsize)
    if dtype is None or tokens.dtype.kind != "u":
        raise TypeError(f"token ids must be uint16 or uint32, not {tokens.dtype}")
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, dtype.itemsize, len(tokens), int(tokens.max()) if len(tokens) else 0))
        f.write(tokens.astype(dtype, copy=False).tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path):
    """Make renames in a directory durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_header(path):
    """(dtype, count, offset of the first token, max_id) of a token file, ours or llm.c's; for a
    headerless nanoGPT file, uint16 from offset 0. max_id None: unknown (llm.c's and nanoGPT's).
    A file whose size disagrees with its header is an error."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(LLMC_HEADER)
    if head[:4] == LLMC_MAGIC:
        kind, offset, expected_version, again = "llm.c", LLMC_HEADER, LLMC_VERSION, "download it again"
    elif head[: len(MAGIC)] == MAGIC:
        kind, offset, expected_version, again = "token-file", HEADER.size, VERSION, "prepare the data again"
    else:
        if size % 2:
            raise UserError(
                f"{path} has no token-file header and an odd size ({size} bytes): it is not uint16 "
                f"token ids; prepare the data again"
            )
        return DTYPES[2], size // 2, 0, None
    if size < offset:
        raise UserError(f"{path} is cut off inside its header ({kind}): an interrupted write or copy; {again}")
    if kind == "llm.c":
        (version, count), width, max_id = struct.unpack("<ii", head[4:12]), 2, None
    else:
        _, version, width, count, max_id = HEADER.unpack(head[: HEADER.size])
    if version != expected_version:
        raise UserError(
            f"{path} is {kind} version {version}; this code reads version {expected_version}: update the code "
            f"or {again}"
        )
    if width not in DTYPES:
        raise UserError(f"{path} says its tokens are {width}-byte integers; only 2 and 4 exist: the file is damaged")
    expected = offset + width * count
    if size != expected:
        raise UserError(
            f"{path} should hold {count:,} tokens ({expected:,} bytes) but has {size:,} bytes: "
            f"a truncated or interrupted file; {again}"
        )
    return DTYPES[width], count, offset, max_id


def read(path):
    """A token file's ids, memory-mapped (a 1-D array of its dtype)."""
    dtype, count, offset, _ = read_header(path)
    if count == 0:
        return np.empty(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


def numbered(data_dir, pattern):
    """[(number, path)] of data_dir's files whose names fullmatch `pattern` (group 1: 6 digits), in order."""
    found = []
    for path in glob.glob(os.path.join(glob.escape(data_dir), "*.bin")):
        m = re.fullmatch(pattern, os.path.basename(path))
        if m:
            found.append((int(m.group(1)), path))
    return sorted(found)


def split_paths(data_dir, split):
    """The files of a split in order: [<split>.bin], its shards <split>_000000.bin, ..., or
    llm.c's shards <name>_<split>_NNNNNN.bin, numbered on from the first (val 000000, train 000001)."""
    single = os.path.join(data_dir, f"{split}.bin")
    ours = numbered(data_dir, re.escape(split) + r"_(\d{6})\.bin")
    llmc = numbered(data_dir, r".+_" + re.escape(split) + r"_(\d{6})\.bin")
    prepare = f"python {os.path.join(data_dir, 'prepare.py')}"
    prefixes = sorted({os.path.basename(p)[: -len(f"_{split}_000000.bin")] for _, p in llmc})
    found = [f"{split}.bin"] * os.path.exists(single) + [f"{split}_000000.bin..."] * bool(ours)
    found += [f"{prefix}_{split}_NNNNNN.bin" for prefix in prefixes]
    if len(found) > 1:
        raise UserError(f"{data_dir} has both {found[0]} and {found[1]}: two preparations mixed; keep one of them")
    if os.path.exists(single):
        return [single]
    if not found:
        raise UserError(
            f"{single} not found (nor {split}_000000.bin, nor llm.c's <name>_{split}_NNNNNN.bin): run {prepare} first"
        )
    shards, first = (ours, 0) if ours else (llmc, min(1, llmc[0][0]))  # llm.c's train starts at 000001
    numbers = [n for n, _ in shards]
    missing = sorted(set(range(first, numbers[-1] + 1)) - set(numbers))
    if missing:
        name = re.sub(r"\d{6}(?=\.bin$)", f"{missing[0]:06d}", os.path.basename(shards[0][1]))
        again = f"run {prepare} again (it resumes)" if ours else "download it"
        raise UserError(f"{data_dir} lacks shard {name} of {len(shards) + len(missing)}: {again}")
    return [p for _, p in shards]


class Tokens:
    """A split's token ids as one 1-D sequence over its files: len(), data[a:b] and
    data[index array] (any shape, e.g. (B, T+1) windows) give numpy arrays, as indexing one
    array would. The ids stay memory-mapped, or are read into one array by in_ram()."""

    def __init__(self, paths, parts, file_starts=None, max_ids=None):
        self.paths, self.parts = list(paths), list(parts)
        self.max_ids = max_ids or [None] * len(self.paths)  # per file, from its header; None: unknown
        self.dtype = np.result_type(*[p.dtype for p in self.parts])
        # (n_parts + 1,): part i is [starts[i], starts[i+1])
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])
        self.file_starts = self.starts if file_starts is None else file_starts  # the same, per file

    @classmethod
    def open(cls, data_dir, split):
        paths = split_paths(data_dir, split)
        parts = [read(p) for p in paths]
        data = cls(paths, parts, max_ids=[read_header(p)[3] for p in paths])
        if len(data) == 0:
            raise UserError(f"{paths[0]} is empty: run python {os.path.join(data_dir, 'prepare.py')} again")
        return data

    def in_ram(self):
        """The same tokens read into one array: random windows then cost no page faults."""
        whole = np.empty(len(self), self.dtype)
        for part, start in zip(self.parts, self.starts):
            whole[start : start + len(part)] = part
        # errors still name the file a token came from
        return Tokens(self.paths, [whole], self.file_starts, self.max_ids)

    @property
    def memmapped(self):
        return any(isinstance(p, np.memmap) for p in self.parts)

    @property
    def nbytes(self):
        return sum(p.nbytes for p in self.parts)

    def __len__(self):
        return int(self.starts[-1])

    def __array__(self, dtype=None, copy=None):
        whole = self[0 : len(self)]
        return whole if dtype is None else whole.astype(dtype)

    def __getitem__(self, key):
        if len(self.parts) == 1:
            return np.asarray(self.parts[0][key])
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise IndexError("token sequences slice with step 1 only")
            stop = max(start, stop)
            first = np.searchsorted(self.starts, start, side="right") - 1
            pieces = []
            for i in range(first, len(self.parts)):
                if self.starts[i] >= stop:
                    break
                pieces.append(self.parts[i][max(start - self.starts[i], 0) : stop - self.starts[i]])
            return np.concatenate(pieces) if pieces else np.empty(0, self.dtype)
        index = np.asarray(key)
        if index.dtype.kind not in "iu":
            raise IndexError(f"token sequences take integer indices or slices, not {index.dtype}")
        if ((index < 0) | (index >= len(self))).any():
            raise IndexError(f"index out of range for {len(self)} tokens")
        flat = index.reshape(-1)
        part = np.searchsorted(self.starts, flat, side="right") - 1
        out = np.empty(flat.shape, self.dtype)
        for i in np.unique(part):  # one vectorized gather per shard touched
            mask = part == i
            out[mask] = self.parts[i][flat[mask] - self.starts[i]]
        return out.reshape(index.shape)

    def check_vocab(self, vocab_size):
        """Raise a UserError naming the file, the id and vocab_size when any id is >= vocab_size.
        Reads the split once, in chunks, so a memory-mapped split stays out of RAM."""
        if np.iinfo(self.dtype).max < vocab_size:
            return  # no id this dtype can hold is out of range
        if all(m is not None and m < vocab_size for m in self.max_ids):
            return  # every file's header vouches for its ids: nothing to read
        for part, start in zip(self.parts, self.starts):
            for lo in range(0, len(part), CHECK_CHUNK):
                chunk = part[lo : lo + CHECK_CHUNK]
                if chunk.max() >= vocab_size:
                    at = int(np.argmax(chunk >= vocab_size))
                    self._bad_token(int(chunk[at]), start + lo + at, vocab_size)

    def _bad_token(self, token, position, vocab_size):
        i = int(np.searchsorted(self.file_starts, position, side="right") - 1)
        raise UserError(
            f"{self.paths[i]} holds token id {token} (token {position - self.file_starts[i]:,} of the file) but "
            f"the model's vocab_size is {vocab_size}: the data was made with another tokenizer than its "
            f"meta.json says; prepare it again"
        )
