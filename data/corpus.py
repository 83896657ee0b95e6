"""The preparation routine behind data/<name>/prepare.py: documents from a Hugging Face dataset
or local files -> token shards for the val, test and train splits. The scripts only set defaults.

    python data/fineweb_edu/prepare.py --tokens=10e9                 # stream, tokenize, write shards
    python data/fineweb_edu/prepare.py --estimate=2000               # tokens per document, before committing
    python data/fineweb_edu/prepare.py --input docs/ --out_dir=/tmp/x    # local .txt/.jsonl/.parquet files
    python data/fineweb_edu/prepare.py --input docs/ --benchmark=20000   # tokens/s for 1..--workers processes

Written to out_dir:
    val_000000.bin, test_000000.bin, train_000000.bin, train_000001.bin, ...  (gpt/data/token_files.py format)
    meta.json      the tokenizer: train.py reads vocab_size from it, sample.py how to decode
    prepare.json   the settings and how far the run got; run the same command again after an
                   interruption and it resumes after the last complete shard, writing the same bytes

The documents come in a seeded order: a Hub dataset is streamed with its own shuffle (shard
order, then a buffer of --shuffle_buffer documents); local files get the same two steps here.
The first --val_tokens tokens are val, the next --test_tokens test, the rest train, --tokens in
all. A split holds whole documents: the one that crosses a split's end is cut there and its
remainder dropped, so no document is in two splits. Every document ends with end-of-text.

Local files: .txt (a whole file is one document, or pieces of it with --txt_separator), .jsonl
(one JSON object per line, the text in --text_field), .parquet (the --text_field column);
.txt.gz and .jsonl.gz are read as they are. A directory means the files under it.
"""

import argparse
import concurrent.futures
import contextlib
import gzip
import itertools
import json
import math
import multiprocessing
import os
import signal
import statistics
import time
from collections import deque

import numpy as np

from configurator import Parser, UserError
from gpt.data import token_files, tokenizer

SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".parquet")
SPLITS = ("val", "test", "train")  # in stream order: the held-out splits come first, so --tokens never moves them
BATCH_CHARS = 1 << 18  # text per task sent to a worker process: ~60k GPT-2 tokens, small enough to share out evenly


# ---------------------------------------------------------------------------- command line


def count(text):
    """A token count: '10e9', '100_000_000' or '1000'."""
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number")
    if value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens")
    return int(value)


def parse_args(argv, doc, **defaults):
    """The routine's options with a script's defaults (its dataset, out_dir, split sizes)."""
    p = Parser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_argument_group("source: a Hugging Face dataset, or local files (--input)")
    source.add_argument("--dataset", help="Hugging Face dataset name, e.g. HuggingFaceFW/fineweb-edu")
    source.add_argument("--name", help="its configuration, e.g. sample-10BT")
    source.add_argument("--split", default="train", help="its split (default: train)")
    source.add_argument("--revision", help="a git revision of the dataset repo (default: main)")
    source.add_argument(
        "--input", nargs="+", metavar="PATH", help="local .txt/.jsonl/.parquet files or directories; replaces --dataset"
    )
    source.add_argument("--text_field", default="text", help="the field or column holding the text (default: text)")
    source.add_argument(
        "--txt_separator",
        help=r"split .txt files into documents at this string, e.g. '\n\n' (default: one document per file)",
    )
    out = p.add_argument_group("output")
    out.add_argument("--out_dir", help="where the shards, meta.json and prepare.json go")
    out.add_argument(
        "--tokenizer",
        default="gpt2",
        help="a tiktoken name (gpt2, cl100k_base) or a Hugging Face tokenizer.json (default: gpt2)",
    )
    out.add_argument(
        "--tokens", type=count, help="stop after this many tokens in all splits, e.g. 10e9 (default: all of the input)"
    )
    out.add_argument(
        "--val_tokens", type=count, default=1_000_000, help="tokens in the val split (default: %(default)s)"
    )
    out.add_argument(
        "--test_tokens", type=count, default=1_000_000, help="tokens in the test split; 0: none (default: %(default)s)"
    )
    out.add_argument(
        "--shard_tokens", type=count, default=100_000_000, help="tokens per shard file (default: %(default)s)"
    )
    out.add_argument("--seed", type=int, default=1337, help="the document order (default: %(default)s)")
    out.add_argument(
        "--shuffle_buffer",
        type=count,
        default=10_000,
        help="documents shuffled together; 0: input order (default: %(default)s)",
    )
    run = p.add_argument_group("running")
    run.add_argument(
        "--workers", type=int, default=os.cpu_count(), help="tokenizer processes (default: all %(default)s cores)"
    )
    run.add_argument(
        "--estimate",
        type=count,
        default=0,
        metavar="N",
        help="tokenize the first N documents, report tokens per document and the documents --tokens needs, write nothing",
    )
    run.add_argument(
        "--benchmark",
        type=count,
        default=0,
        metavar="N",
        help="tokenize the first N documents with 1..--workers processes and plain tiktoken, report tokens/s, write nothing",
    )
    p.set_defaults(**defaults)
    args = p.parse_args(argv)
    if args.out_dir is None:
        raise UserError("pass --out_dir")
    if args.txt_separator is not None:
        args.txt_separator = args.txt_separator.replace("\\n", "\n").replace("\\t", "\t")
    if args.workers < 1:
        raise UserError(f"--workers={args.workers}: at least 1")
    if args.shard_tokens < 1:
        raise UserError("--shard_tokens must be at least 1")
    if args.tokens is not None and args.tokens <= args.val_tokens + args.test_tokens:
        raise UserError(
            f"--tokens={args.tokens:,} leaves nothing for train after --val_tokens={args.val_tokens:,} and "
            f"--test_tokens={args.test_tokens:,}; raise --tokens or lower those"
        )
    return args


def main(argv=None, doc=None, **defaults):
    """Entry point of the prepare scripts: python data/<name>/prepare.py [options]."""
    return run(parse_args(argv, doc, **defaults))


def run(args):
    if args.input is None and args.dataset is None:
        raise UserError("no source: pass --dataset NAME (Hugging Face) or --input PATH (local files)")
    spec = tokenizer.make_spec(args.tokenizer)
    if args.estimate:
        return estimate(args, spec)
    if args.benchmark:
        return benchmark(args, spec)
    return prepare(args, spec)


# ---------------------------------------------------------------------------- documents


def documents(args):
    """The documents in their seeded order (skipping empty ones): an iterator of strings."""
    if args.input is not None:
        return local_documents(
            input_files(args.input), args.text_field, args.txt_separator, args.seed, args.shuffle_buffer
        )
    return hub_documents(args)


def input_files(paths):
    """The files named by --input, directories expanded to the readable files under them, sorted."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(
                os.path.join(root, f) for root, _, names in os.walk(path) for f in names if f.endswith(SUFFIXES)
            )
            if not found:
                raise UserError(f"--input {path} holds no {'/'.join(SUFFIXES)} files")
            files += found
        elif not os.path.isfile(path):
            raise UserError(f"--input {path} does not exist")
        elif not path.endswith(SUFFIXES):
            raise UserError(f"--input {path}: cannot read this kind of file; use {', '.join(SUFFIXES)}")
        else:
            files.append(path)
    return files


def local_documents(files, text_field, separator, seed, buffer_size):
    rng = np.random.default_rng(seed)
    order = [files[i] for i in rng.permutation(len(files))] if buffer_size else files
    docs = (doc for path in order for doc in read_file(path, text_field, separator) if doc.strip())
    return buffer_shuffle(docs, buffer_size, rng)


def buffer_shuffle(items, buffer_size, rng):
    """An approximate shuffle in bounded memory, as the Hub's streaming datasets do it: each new
    item takes the place of a random one of the last buffer_size, which is yielded."""
    if buffer_size == 0:
        yield from items
        return
    buffer = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        i = rng.integers(buffer_size)
        yield buffer[i]
        buffer[i] = item
    rng.shuffle(buffer)
    yield from buffer


def read_file(path, text_field, separator):
    """The documents of one local file."""
    if path.endswith(".parquet"):
        yield from read_parquet(path, text_field)
        return
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            if path.endswith((".jsonl", ".jsonl.gz")):
                for line_no, line in enumerate(f, 1):
                    if line.strip():
                        yield json_text(line, text_field, f"{path}:{line_no}")
            elif separator is None:
                yield f.read()
            else:
                yield from split_stream(f, separator)
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text")
    except (OSError, EOFError) as e:  # unreadable, or a damaged .gz
        raise UserError(f"cannot read {path} ({e})")


def json_text(line, field, where):
    try:
        record = json.loads(line)
    except ValueError:
        raise UserError(f"{where} is not a JSON object; .jsonl files hold one per line")
    if not isinstance(record, dict) or not isinstance(record.get(field), str):
        keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise UserError(f"{where} has no text field {field!r} (it has: {keys}); pass --text_field")
    return record[field]


def split_stream(f, separator, chunk_chars=1 << 24):
    """Pieces of a text file between separators, read in chunks (a file may be larger than RAM)."""
    rest = ""
    while chunk := f.read(chunk_chars):
        pieces = (rest + chunk).split(separator)
        rest = pieces.pop()
        yield from pieces
    yield rest


def read_parquet(path, field):
    import pyarrow.parquet as pq  # installed with datasets

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's errors for a file that is not parquet are its own types
        raise UserError(f"cannot read {path} as parquet ({str(e).splitlines()[0]})")
    if field not in pf.schema_arrow.names:
        raise UserError(
            f"{path} has no column {field!r} (it has: {', '.join(pf.schema_arrow.names)}); pass --text_field"
        )
    for batch in pf.iter_batches(columns=[field], batch_size=1024):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


def hub_documents(args):
    """A Hugging Face dataset, streamed and shuffled with the seed. The Hub is asked first, with a
    timeout and no retries, so an unknown name or a missing network is one line at once (the
    datasets library would retry for half a minute), before anything is written."""
    import datasets
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    name = args.dataset
    local = "pass local files with --input PATH (.txt, .jsonl, .parquet)"
    try:
        HfApi().dataset_info(name, revision=args.revision, timeout=20)
    except GatedRepoError:
        raise UserError(f"{name} is gated on Hugging Face: accept its terms on its page, then `hf auth login`")
    except RepositoryNotFoundError:
        raise UserError(
            f"there is no dataset {name!r} on Hugging Face (a private one needs `hf auth login`); "
            f"check the name, or {local}"
        )
    except Exception as e:  # offline mode, DNS, no route, TLS, timeout: the Hub cannot be used now
        raise UserError(f"cannot reach Hugging Face for {name!r} ({first_line(e)}); {local}")
    try:
        ds = datasets.load_dataset(name, args.name, split=args.split, revision=args.revision, streaming=True)
    except Exception as e:  # a wrong config or split name, a loading-script dataset: the library's message says which
        raise UserError(f"cannot open {name} (name={args.name}, split={args.split}): {first_line(e)}")
    if args.shuffle_buffer:
        ds = ds.shuffle(seed=args.seed, buffer_size=args.shuffle_buffer)
    return hub_texts(ds, args)


def hub_texts(ds, args):
    name, rows = args.dataset, iter(ds)
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except Exception as e:  # the connection dropped mid-stream (the libraries raise several types)
            raise UserError(
                f"lost Hugging Face while reading {name} ({first_line(e)}); run the same command "
                f"again to resume after the last complete shard"
            )
        text = row.get(args.text_field)
        if not isinstance(text, str):
            raise UserError(
                f"{name} has no text field {args.text_field!r} (it has: {', '.join(row)}); pass --text_field"
            )
        if text.strip():
            yield text


def first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# ---------------------------------------------------------------------------- tokenizing


def text_batches(docs, max_chars=BATCH_CHARS):
    """Lists of consecutive documents of about max_chars text each."""
    batch, size = [], 0
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= max_chars:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


class Encoder:
    """list of documents -> (ids, ends): every document's ids followed by end-of-text, in one
    array of the split files' dtype, and ends[i] = where document i's ids end in it."""

    def __init__(self, spec):
        self.encode = tokenizer.batch_encoder(spec)
        self.eot = tokenizer.eot(spec)
        self.dtype = token_files.dtype_for(tokenizer.vocab_size(spec))

    def __call__(self, docs):
        lists = self.encode(docs)
        ends = np.cumsum([len(ids) + 1 for ids in lists])
        ids = np.fromiter(itertools.chain.from_iterable(ids + [self.eot] for ids in lists), self.dtype, count=ends[-1])
        return ids, ends


_worker_encoder = None


def _start_worker(spec):
    global _worker_encoder
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle, without a traceback per worker
    _worker_encoder = Encoder(spec)


def _encode_in_worker(docs):
    return _worker_encoder(docs)


@contextlib.contextmanager
def encoder_pool(spec, workers):
    """A function: iterator of document batches -> iterator of Encoder results, in order. With
    workers > 1, worker processes tokenize while this one reads the input and writes shards; at
    most 2 batches per worker are in flight, so a fast source never piles up in memory."""
    if workers == 1:
        encode = Encoder(spec)
        yield lambda batches: map(encode, batches)
        return
    # forkserver, not fork: the workers start from a clean process, so no lock held by one of
    # this process's threads (torch's, a tokenizer library's, HTTP) can be copied into them locked.
    # An executor, not multiprocessing.Pool: Pool.terminate() can hang for good when an error
    # stops the reader while its task thread is still writing a batch into a worker's pipe.
    pool = concurrent.futures.ProcessPoolExecutor(
        workers, multiprocessing.get_context("forkserver"), initializer=_start_worker, initargs=(spec,)
    )

    def run(batches):
        pending = deque()
        for batch in batches:
            pending.append(pool.submit(_encode_in_worker, batch))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    try:
        yield run
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # at most 2 batches per worker were in flight


# ---------------------------------------------------------------------------- writing


def settings(args, spec):
    """What decides the bytes written; a rerun resumes only when they are the same."""
    if args.input is not None:
        files = input_files(args.input)
        source = {
            "files": [[os.path.abspath(f), os.path.getsize(f), os.stat(f).st_mtime_ns] for f in files],
            "text_field": args.text_field,
            "txt_separator": args.txt_separator,
        }
    else:
        source = {k: getattr(args, k) for k in ("dataset", "name", "split", "revision", "text_field")}
    return {
        "source": source,
        "tokenizer": spec,
        **{
            k: getattr(args, k)
            for k in ("tokens", "val_tokens", "test_tokens", "shard_tokens", "seed", "shuffle_buffer")
        },
    }


class Progress:
    """prepare.json: the settings and the shards written so far, with where the stream stands
    after the last one (`next_doc`, and `skip` ids of it already written). Rewritten atomically
    after each shard is renamed into place, so it never lists a shard that is not complete."""

    def __init__(self, out_dir, wanted):
        self.path = os.path.join(out_dir, "prepare.json")
        self.state = {"settings": wanted, "shards": {s: [] for s in SPLITS}, "next_doc": 0, "skip": 0, "done": False}
        if os.path.exists(self.path):
            with open(self.path, encoding="utf-8") as f:
                saved = json.load(f)
            changed = [k for k in wanted if saved["settings"].get(k) != wanted[k]]
            if changed:
                raise UserError(
                    f"{out_dir} holds a preparation with other settings ({', '.join(changed)}); "
                    f"choose another --out_dir, or delete {out_dir} to start over"
                )
            self.state = saved
        for split in SPLITS:  # a listed shard must still be whole: it will not be written again
            for i, n in enumerate(self.state["shards"][split]):
                path = shard_path(out_dir, split, i)
                if not os.path.exists(path) or token_files.read_header(path)[1] != n:
                    raise UserError(
                        f"{path} is missing or changed since it was written; delete {out_dir} to start over"
                    )

    def written(self, split):
        return sum(self.state["shards"][split])

    def save(self, split, n, next_doc, skip, done=False):
        self.state["shards"][split].append(int(n))
        self.state.update(next_doc=int(next_doc), skip=int(skip), done=done)
        self.save_state()

    def save_state(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.state, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        token_files.fsync_dir(os.path.dirname(self.path))


def shard_path(out_dir, split, index):
    return os.path.join(out_dir, f"{split}_{index:06d}.bin")


def refuse_foreign(out_dir):
    """nanoGPT's single-file splits (train.bin) in out_dir are another preparation's: not mixed with shards."""
    foreign = [f"{s}.bin" for s in SPLITS if os.path.exists(os.path.join(out_dir, f"{s}.bin"))]
    if foreign:
        raise UserError(
            f"{out_dir} holds {', '.join(foreign)} from another preparation; move it away or choose another --out_dir"
        )


def write_meta(out_dir, spec):
    """meta.json, the tokenizer: written before the first shard."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(spec, f)
    except OSError as e:
        raise UserError(f"cannot write to --out_dir {out_dir} ({e.strerror})")


def prepare(args, spec):
    """Stream, tokenize and write the splits; resumes a run that stopped."""
    out_dir = args.out_dir
    refuse_foreign(out_dir)
    progress = Progress(out_dir, settings(args, spec))
    state = progress.state
    if state["done"]:
        print(f"{out_dir} is already prepared ({summary(progress)}); delete it to prepare again")
        return 0
    quotas = {"val": args.val_tokens, "test": args.test_tokens, "train": math.inf}
    if args.tokens is not None:
        quotas["train"] = args.tokens - args.val_tokens - args.test_tokens
    plan = [s for s in SPLITS if quotas[s] > 0 and progress.written(s) < quotas[s]]  # the splits still to fill
    buf = np.empty(min(args.shard_tokens, sum(quotas.values())), token_files.dtype_for(tokenizer.vocab_size(spec)))
    fill = 0  # ids in buf: the shard being filled
    done_before = sum(progress.written(s) for s in SPLITS)
    start, doc_index = time.perf_counter(), state["next_doc"]  # doc_index: the stream position of the batch in hand
    skip = state["skip"]  # ids of the document at next_doc that the last complete shard already holds
    if doc_index:
        print(f"resuming after {summary(progress)}: skipping the first {doc_index:,} documents")

    from tqdm import tqdm

    with contextlib.ExitStack() as stack:
        encode_all = stack.enter_context(encoder_pool(spec, args.workers))
        docs = itertools.islice(documents(args), doc_index, None)
        batches = encode_all(text_batches(docs))
        first = next(batches, None)  # a source that cannot be read stops here, before anything is written
        if first is None and doc_index == 0:
            raise UserError("the input has no documents")
        write_meta(out_dir, spec)
        bar = stack.enter_context(
            tqdm(total=args.tokens, initial=done_before, unit="tok", unit_scale=True, disable=None)
        )
        for ids, ends in itertools.chain([first] if first else [], batches):
            pos, skip = skip, 0
            while pos < len(ids) and plan:
                split = plan[0]
                room = min(len(buf) - fill, quotas[split] - progress.written(split) - fill)
                take = min(room, len(ids) - pos)
                buf[fill : fill + take] = ids[pos : pos + take]
                fill, pos = fill + take, pos + take
                bar.update(take)
                split_full = progress.written(split) + fill == quotas[split]
                if fill < len(buf) and not split_full:
                    continue
                if split_full:  # drop the rest of the document cut at the split's end
                    pos = int(ends[np.searchsorted(ends, pos - 1, side="right")])
                j = int(np.searchsorted(ends, pos, side="right"))  # the document pos is in (len(ends): none left)
                next_skip = pos - (int(ends[j - 1]) if j else 0) if j < len(ends) else 0
                token_files.write(shard_path(out_dir, split, len(state["shards"][split])), buf[:fill])
                if split_full:
                    plan.pop(0)
                progress.save(split, fill, doc_index + j, next_skip, done=not plan)
                fill = 0
            doc_index += len(ends)
            if not plan:
                break
        else:  # the input ran out before the budget
            if fill:
                token_files.write(shard_path(out_dir, plan[0], len(state["shards"][plan[0]])), buf[:fill])
                progress.save(plan[0], fill, doc_index, 0)
            if progress.written("train") == 0:
                raise UserError(
                    f"the input ran out after {summary(progress) or 'no tokens'}, before any train "
                    f"tokens; lower --val_tokens/--test_tokens or add input"
                )
            state["done"] = True
            progress.save_state()
            if args.tokens is not None:
                print(f"note: the input ran out before --tokens={args.tokens:,}")
    seconds = time.perf_counter() - start
    new = sum(progress.written(s) for s in SPLITS) - done_before
    print(
        f"{out_dir}: {summary(progress)}; {doc_index:,} documents read; {new:,} tokens in {seconds:.1f} s "
        f"({new / max(seconds, 1e-9):,.0f} tokens/s, {args.workers} worker(s))"
    )
    return 0


def summary(progress):
    return ", ".join(
        f"{s} {progress.written(s):,} tokens in {len(progress.state['shards'][s])} shard(s)"
        for s in SPLITS
        if progress.state["shards"][s]
    )


# ---------------------------------------------------------------------------- measuring


def estimate(args, spec):
    """Tokenize the first --estimate documents and report what a budget needs, writing nothing."""
    with encoder_pool(spec, args.workers) as encode_all:
        docs = itertools.islice(documents(args), args.estimate)
        lengths = np.concatenate([np.diff(ends, prepend=0) for _, ends in encode_all(text_batches(docs))] or [[]])
    if len(lengths) == 0:
        raise UserError("the input has no documents")
    mean = lengths.mean()
    print(
        f"{len(lengths):,} documents: {mean:,.1f} tokens per document on average, median {statistics.median(lengths):,.0f}, "
        f"from {lengths.min():,} to {lengths.max():,} (each with its end-of-text token)"
    )
    budget = args.tokens if args.tokens is not None else None
    if budget is not None:
        print(
            f"--tokens={budget:,} needs about {math.ceil(budget / mean):,} documents "
            f"(val {math.ceil(args.val_tokens / mean):,}, test {math.ceil(args.test_tokens / mean):,})"
        )
    return 0


def benchmark(args, spec):
    """Tokens/s of this routine's tokenizing with 1..--workers processes, against plain tiktoken
    encode_ordinary_batch on one thread, on the first --benchmark documents (held in memory,
    so reading the input is not timed)."""
    docs = list(itertools.islice(documents(args), args.benchmark))
    if not docs:
        raise UserError("the input has no documents")
    batches = list(text_batches(docs))
    print(
        f"{len(docs):,} documents, {sum(map(len, docs)) / 1e6:.1f} MB of text, {len(batches)} batches; "
        f"{os.cpu_count()} CPU cores"
    )
    rows = []
    if spec["kind"] == "tiktoken":
        enc = tokenizer.encoding(spec["name"])
        for threads in sorted({1, args.workers}):
            t0 = time.perf_counter()
            n = sum(map(len, enc.encode_ordinary_batch(docs, num_threads=threads))) + len(docs)  # + end-of-text
            rows.append((f"tiktoken encode_ordinary_batch, {threads} thread(s)", n, time.perf_counter() - t0))
    for workers in range(1, args.workers + 1):
        with encoder_pool(spec, workers) as encode_all:
            list(encode_all(batches[:workers]))  # start-up (and the tokenizer's load) in every worker is not timed
            t0 = time.perf_counter()
            n = sum(len(ids) for ids, _ in encode_all(batches))
            rows.append((f"this routine, {workers} worker process(es)", n, time.perf_counter() - t0))
    for label, n, seconds in rows:
        print(f"{label:48s} {n / seconds:>12,.0f} tokens/s  ({n:,} tokens in {seconds:.2f} s)")
    return 0
