"""serve.py's engine: many requests decoded together as they come and go, one forward pass per
step over every row (each at its own length) and the prompts that join them.

    from gpt.inference import engine
    from gpt.weights import load
    model, tok_spec = load.for_inference("resume", "out-chat-demo")
    e = engine.Engine(model, rows=16); e.start(); e.submit(engine.Request(ids, 50, on_token, on_done))
    e.on_step = lambda step: print(len(step.decoding), "rows decode,", len(step.joining), "join")

Reads top to bottom: the batch cache whose rows each have their own length (the decoding step's
view of it and the packed step's), a request, and the Engine, with the compiled decoding step's
settings (compile_options).
"""

import collections
import itertools
import random
import threading
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch._inductor.config  # Engine.compile patches it while compiling

from gpt.inference.sampling import CacheLayer, sample_next

# ---------------------------------------------------------------------------- a batch of any lengths


def common(a, b):
    """How many items the sequences a and b share at their start."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class BatchCache:
    """Keys and values of up to `rows` sequences that each have their own length, for a server
    that decodes them together: row j holds lengths[j] positions, from position 0, and the rest of
    its room is padding that attention masks out. Rows in use are always 0..n-1 (a finished row
    swaps places with the last one), so a step's keys are a slice, never a gather. The whole room of
    every row is allocated when the cache is made and never moves: a compiled step writes into it in place.

    A free row keeps what its last sequence left, and `kept[j]` says which token ids those are: a new
    prompt that starts with them (a conversation's next turn, a system prompt, a prompt asked again)
    runs only the rest (reuse). The row that has been free longest is the first to be overwritten."""

    def __init__(self, config, rows, room, dtype, device):
        assert room <= config.block_size
        self.config, self.rows, self.room = config, rows, room
        # a tensor per layer, (rows + 1, n_kv, room + 1, hs), zeros: padding must be finite (0 * NaN is NaN). Per
        # layer, so that a compiled step's write of new keys is an index_put into one of its inputs, which
        # inductor does in place (into a view of one (L, ...) tensor, it copied the whole cache every step).
        # A row and a position more than the rows and the room: a compiled step's slice of rows and span of
        # keys is then never the whole dimension, where its strides would be a contiguous tensor's and
        # torch.compile would specialize the graph on that size
        shape = (rows + 1, config.n_kv_head, room + 1, config.n_embd // config.n_head)
        self.k, self.v = ([torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layer)] for _ in "kv")
        self.lengths = [0] * rows
        self.kept = [[] for _ in range(rows)]  # of a free row: the ids of its keys and values
        self.freed = [-1] * rows  # when each free row's sequence ended (the count of sequences kept); -1: holds none
        self.count = 0

    def swap(self, a, b):
        """Rows a and b change places (their keys, values, lengths and kept ids)."""
        if a != b:
            n, pair = max(self.lengths[a], self.lengths[b]), torch.tensor([a, b], device=self.k[0].device)
            for t in (*self.k, *self.v):
                t[pair.flip(0), :, :n] = t[pair, :, :n]  # the right side is read whole first
            for x in (self.lengths, self.kept, self.freed):
                x[a], x[b] = x[b], x[a]

    def keep(self, row, ids):
        """Row `row` is free and holds the keys and values of ids."""
        self.count += 1
        self.kept[row], self.freed[row] = ids, self.count

    def reuse(self, row, ids):
        """Make `row` (one of the free rows row, row+1, ...) a new sequence's, holding the longest start
        of ids that a free row holds, all of them but the last (its logits are the step's): how many
        ids it holds. It is that row itself when that start is all it held; otherwise the row free
        longest (one that holds nothing, first) gets a copy of that start, and the rest stays."""
        free = range(row, self.rows)
        shared = {j: common(self.kept[j], ids[:-1]) for j in free}
        best = max(free, key=lambda j: (shared[j], -len(self.kept[j])))
        spare, most = min(free, key=lambda j: self.freed[j]), shared[best]
        if most < len(self.kept[best]) and spare != best:
            for t in (*self.k, *self.v):
                t[spare, :, :most] = t[best, :, :most]
            self.lengths[spare], best = most, spare  # what the swap below moves: the copy, whatever spare held
        self.swap(row, best)
        self.kept[row], self.freed[row] = [], -1
        return most

    def packed(self, n, prompts, starts, device):
        """The cache GPT.forward takes for one step of a server: a new token in each of rows
        0..n-1, and the prompt of each new row n, n+1, ... from its start (the positions the row holds
        already), packed into one sequence."""
        return Packed(self, n, [len(p) for p in prompts], starts, device)


class Decoding:
    """One decoding step of rows 0..B-1 of a BatchCache, as GPT.forward takes a cache: idx (B, 1),
    row b's new token at positions[b], attending to the keys before it in its own row. keys (S,):
    0..S-1, the positions attention reads (S > every position), so that every tensor's shape is
    (B, ...) or (S, ...) and a compiled step takes any S in one graph. rows (B,): where each writes
    its key and value, b itself, or for rows of padding (a bucket's size) the cache's spare row,
    so that a free row keeps what it holds."""

    def __init__(self, cache, rows, positions, keys, fused=False):
        # rows and positions (B,) each; fused: one_query_attention rather than the model's SDPA
        self.cache, self.rows, self.pos, self.fused = cache, rows, positions, fused
        self.mask = (keys[None, :] <= positions[:, None])[:, None, None, :]  # (B, 1, 1, S): its cached keys and its own

    def positions(self, T, device):
        return self.pos[:, None]  # (B, 1)

    def layer(self, i):
        return CacheLayer(self, i)

    def attend(self, i, q, k, v, sdpa):
        """Layer i: q (B, nh, 1, hs), k and v (B, n_kv, 1, hs): store each row's new key and value at its
        position, and attend over its row's keys (B, n_kv, S, hs): (B, nh, 1, hs)."""
        c, B, S = self.cache, q.size(0), self.mask.size(-1)
        c.k[i][self.rows, :, self.pos], c.v[i][self.rows, :, self.pos] = k[:, :, 0], v[:, :, 0]
        attention = one_query_attention if self.fused else sdpa
        return attention(q, c.k[i][:B, :, :S], c.v[i][:B, :, :S], self.mask)


def one_query_attention(q, k, v, mask):
    """Attention of one query per row, q (B, nh, 1, hs), over k, v (B, n_kv, S, hs), the keys mask
    (B, 1, 1, S) lets it see: SDPA's result in products, sums and a softmax (in float32), which a
    compiled CPU step fuses into a few loops of its own: with SDPA's kernel, the 124M's attention at 16
    rows took twice as long (8-11 ms a step against 5.4-5.8)."""
    B, nh, _, hs = q.shape
    n_kv = k.size(1)
    q = q.float().view(B, n_kv, nh // n_kv, 1, hs)  # each k/v head's group of query heads
    scores = (q * k.float()[:, :, None]).sum(-1) * hs**-0.5  # (B, n_kv, group, S)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
    y = (weights[..., None] * v.float()[:, :, None]).sum(-2)  # (B, n_kv, group, hs)
    return y.view(B, nh, 1, hs).to(v.dtype)


class Packed:
    """One forward pass over the rows of a BatchCache, packed into a single sequence (1, N): rows
    0..n-1 add one token each at their own position (length), and new rows n, n+1, ... add their
    prompts from their start (0, or the positions the row holds already). The matmuls so run over
    exactly the N real tokens, with no padding and one pass for everything (decoding and prompts);
    attention runs sequence by sequence: one masked pass over the cache for the decoding rows, one
    causal pass per prompt (over its own keys, or its row's from position 0 when it starts later).
    GPT.forward takes it as it takes a KVCache (positions, layer); `last` is where each row's logits
    are read (its token, or its prompt's last). The Engine advances the cache's lengths."""

    def __init__(self, cache, n, sizes, starts, device):
        lengths = cache.lengths[:n]
        self.end_decoding = max(lengths, default=-1) + 1  # the decoding rows' keys, new ones included
        self.end = max(self.end_decoding, *(a + b for a, b in zip(starts, sizes)), 0)
        if self.end > cache.room:
            raise ValueError(f"a row of length {self.end} does not fit the cache's room of {cache.room}")
        if n + len(sizes) > cache.rows:
            raise ValueError(f"{n + len(sizes)} rows do not fit the cache's {cache.rows}")
        self.cache, self.n, self.sizes, self.starts = cache, n, sizes, starts
        rows = list(range(n)) + [n + r for r, size in enumerate(sizes) for _ in range(size)]  # each token's row
        # each token's position in its row, and where each prompt starts in the packed sequence, then ends
        columns = lengths + [j for start, size in zip(starts, sizes) for j in range(start, start + size)]
        ends = list(itertools.accumulate(sizes, initial=n))
        last = list(range(n)) + [end - 1 for end in ends[1:]]  # each row's last token
        self.rows, self.columns, self.last = (torch.tensor(x, device=device) for x in (rows, columns, last))
        self.packed_positions = torch.tensor([columns], device=device)  # (1, N): GPT.forward's positions
        if n:  # key j is seen by decoding row r's query when j <= lengths[r]: its cached keys and its new one
            keys = torch.arange(self.end_decoding, device=device)
            self.mask = (keys[None, :] <= self.columns[:n, None])[:, None, None, :]  # (n, 1, 1, end_decoding)
        # a prompt after the positions its row holds: its new token t sees positions 0..start+t of the row
        self.prompt_masks = [
            torch.ones(size, start + size, dtype=torch.bool, device=device).tril(start) if start else None
            for start, size in zip(starts, sizes)
        ]

    def positions(self, T, device):
        return self.packed_positions  # (1, N): every token's position in its own row

    def layer(self, i):
        return CacheLayer(self, i)

    def attend(self, i, q, k, v, sdpa):
        """Layer i: q (1, nh, N, hs), k and v (1, n_kv, N, hs) of the packed tokens: store every token's
        key and value at its row and position, and return the attention output (1, nh, N, hs)."""
        c = self.cache
        c.k[i][self.rows, :, self.columns] = k[0].transpose(0, 1)  # (N, n_kv, hs), each at its own row and position
        c.v[i][self.rows, :, self.columns] = v[0].transpose(0, 1)
        parts, n = [], self.n
        if n:  # the decoding rows: one query each, over their cached keys (n, n_kv, end, hs), masked per row
            end = self.end_decoding
            y = sdpa(q[0, :, :n, None].transpose(0, 1), c.k[i][:n, :, :end], c.v[i][:n, :, :end], self.mask)
            parts.append(y[:, :, 0].transpose(0, 1)[None])  # (n, nh, 1, hs) -> (1, nh, n, hs)
        at = n
        for row, (start, size, mask) in enumerate(zip(self.starts, self.sizes, self.prompt_masks), n):
            part = slice(at, at + size)
            if start == 0:  # over its own keys, causal: what it gets alone
                parts.append(sdpa(q[:, :, part], k[:, :, part], v[:, :, part], None, True))
            else:  # after the held ones, over its row's keys from position 0
                keys, values = (t[i][row : row + 1, :, : start + size] for t in (c.k, c.v))  # (1, n_kv, start+size, hs)
                parts.append(sdpa(q[:, :, part], keys, values, mask))
            at += size
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


# ---------------------------------------------------------------------------- the engine


@dataclass(eq=False)
class Request:
    """One generation for the Engine. on_token(id) is called on the engine's thread for every
    token of the reply (not for a stop id) and returns True to end it there (a stop string was
    met); on_done(finish_reason, completion_tokens, error) once, at the end: finish_reason 'stop',
    'length', 'cancelled' or 'error'. Set cancelled from any thread to free its row at the next step."""

    ids: list
    max_tokens: int
    on_token: Callable
    on_done: Callable
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Optional[int] = None
    stop_ids: tuple = ()
    seed: Optional[int] = None
    cancelled: bool = False
    generated: int = 0
    tokens: list = field(default_factory=list)  # the reply's tokens so far; the last is run at the next step
    finished: Optional[str] = None
    error: Optional[str] = None
    generator: Optional[torch.Generator] = field(default=None, repr=False)


@dataclass
class Step:
    """What one step of the Engine is about to run, as on_step gets it: rows 0..n-1 decode, each its
    last token at its position, and the requests that join take rows n, n+1, ..., each running its
    prompt from its start, the positions its row holds already (BatchCache.reuse). packed: the prompts
    run packed after the rows' tokens; else it is the decoding step, each joining prompt running its
    last token. rows and keys: the rows computed and the span of keys read (padded, when compiled)."""

    decoding: list  # the requests of rows 0..n-1
    positions: list  # where each of them writes its token (the positions its row holds)
    joining: list  # the requests that join
    starts: list  # where each of them starts
    tokens: int  # the tokens the pass runs: one per decoding row, and each joining prompt's rest
    packed: bool
    rows: int
    keys: int


def compile_options(device_type):
    """Engine.compile's settings for the decoding step on device_type. On a GPU the step replays a CUDA
    graph. On a CPU the weights are frozen into the graphs, the kernels called from C++ (cpp_wrapper),
    and each matmul's weights packed once (a second copy of them): up to 4 rows, for inductor's own
    C++ GEMM kernels (max_autotune's CPP backend), which read the 124M's weights at the cores'
    bandwidth (on an AMD EPYC a step of 2 or 4 rows took as long as one); for 5 or more, for oneDNN's
    (freezing's own packing at a symbolic row count): 1.8x faster than those kernels at 16 rows, 1.2x
    at 8, 1.3-1.6x slower at 2-4 (BENCHMARKS.md). Attention there is one_query_attention's, over keys
    padded to a multiple of 16 (a GPU's CUDA graphs record one graph per span of keys: there, of 64
    or more)."""
    if device_type == "cuda":
        return {"mode": "reduce-overhead"}
    one_row = {
        "freezing": True,
        "max_autotune": True,
        "max_autotune_gemm_backends": "CPP",
        "autotune_fallback_to_aten": True,
    }
    return {
        "options": {"cpp_wrapper": True},
        "graphs": [(1, one_row), (4, one_row), (None, {"freezing": True})],
        "fused_attention": True,
        "key_grain": 16,
    }


class Engine:
    """Decodes every request it holds together: one forward pass per step over all active rows,
    each row at its own position with its own stop. The requests that arrive between two steps
    join at the next one: their prompts go into that same forward pass, packed after the active
    rows' tokens, so a step that takes in new requests is still one pass. One that finishes or is
    cancelled leaves before the next step. At most `rows` run at once and `waiting` wait; submit()
    refuses more (the server's 429). One thread owns the model, and computes in its dtype.

    A step that only decodes (no prompt joins) is the one a reply spends its time in: compile()
    makes it torch.compile'd graphs made at start-up, over rows padded to a bucket (1, 2, 4, ...,
    rows) and any span of keys, so requests that come and go never compile another.

    To watch it: on_step(step) is called on the engine's thread before each forward pass with what it
    runs (a Step; settable at any time; if it raises, the step's requests end with the error), and
    after_step() after each step, once the ended requests' rows are free. `lock`, a Condition, guards
    the queue and `held` (the requests submitted and not yet done); submit() and close() notify it."""

    def __init__(self, model, rows=16, waiting=64, room=None, device="cpu", after_step=None, on_step=None):
        self.model, self.device = model, device
        self.after_step = after_step or (lambda: None)  # called on the engine's thread after each step
        self.on_step = on_step  # called on the engine's thread with each Step, before its forward pass
        self.rows, self.max_waiting = rows, waiting
        dtype = next(model.parameters()).dtype
        self.cache = BatchCache(model.config, rows, room or model.config.block_size, dtype, device)
        self.keys = torch.arange(self.cache.room, device=device)  # Decoding's keys are a slice of it
        self.decode, self.buckets = self._decode, None  # compile() sets them
        self.fused_attention, self.key_grain, self.graphs = False, None, []  # and these
        self.queue = collections.deque()
        self.active = []  # active[j] is in the cache's row j
        self.lock = threading.Condition()
        self.closed = False
        self.held = 0  # requests submitted and not yet done: decoding, prefilling or waiting
        self.steps = 0  # steps (forward passes) run, for tests and /health
        self.thread = threading.Thread(target=self.run, name="inference-engine", daemon=True)

    def compile(self, graphs=((1, None), (None, None)), fused_attention=False, key_grain=None, **options):
        """torch.compile the decoding step (options: torch.compile's) and compile its graphs now, each
        for any span of keys. graphs: (the most rows, settings of torch._inductor.config while it
        compiles; freezing, say, which options cannot carry) of each graph, from one row's up (None:
        every bucket left): a graph takes the buckets of rows past the last one's most, up to its own,
        for any count of rows among them (one row's: only one). fused_attention: one_query_attention
        rather than the model's SDPA, in a float32 model (in half precision its result, rounded apart
        from the SDPA of the eager passes that run prompts, parted more replies from their solo ones
        where two tokens were nearly tied); key_grain: the span of keys a multiple of it (None:
        _inputs' rule for CUDA graphs). None when done; else the error, and the step stays eager."""
        assert graphs[0][0] == 1, "the first graph is one row's"
        float32 = self.cache.k[0].dtype == torch.float32
        self.fused_attention, self.key_grain = fused_attention and float32, key_grain
        self.buckets = sorted({min(2**i, self.rows) for i in range(self.rows.bit_length() + 1)})
        self.graphs, least = [], 1  # (fewest rows, most rows, inductor settings) of each graph
        for most, settings in graphs:
            most = self.rows if most is None else min(most, self.rows)
            if any(least <= b <= most for b in self.buckets):
                self.graphs.append((least, most, settings or {}))
            least = most + 1
        for t in (*self.cache.k, *self.cache.v):  # the cache keeps its address (CUDA graphs)
            torch._dynamo.mark_static_address(t)
        step = torch.compile(self._decode, dynamic=False, **options)
        try:
            for rows in self.buckets:  # the decoding steps of `rows` rows
                settings = next(s for least, most, s in self.graphs if least <= rows <= most)
                with torch.inference_mode(), torch._inductor.config.patch(settings):
                    step(*self._inputs([0] * rows, [0] * rows, 1))
        except Exception as e:  # noqa: BLE001 (a compiler's failure of any kind: serving goes on without it)
            self.buckets, self.fused_attention = None, False
            torch.compiler.reset()
            while (e.__cause__ or e.__context__) is not None:  # dynamo says "backend raised": what did it raise?
                e = e.__cause__ or e.__context__
            message = str(e).strip()
            return f"{type(e).__name__}: {message.splitlines()[0]}" if message else type(e).__name__

        def decode(*inputs):
            # every graph a step needs is made above: dynamo checks only the guards that tell them
            # apart (0.5 ms a step less, 2% of the 124M's on two CPU cores) and compiles no other
            # (a step that none fits would run eagerly, never wait minutes for a compile)
            with torch.compiler.set_stance("eager_on_recompile", skip_guard_eval_unsafe=True):
                return step(*inputs)

        self.decode = decode
        return None

    def _inputs(self, tokens, positions, end):
        """The decoding step's inputs for rows 0..n-1 whose longest ends at `end`: tokens, rows and
        positions (B,), keys (S,). Compiled: B the next bucket of rows (rows of padding write into the
        spare row) and S rounded up (keys past a row's end are read, and masked), both sizes symbolic
        (B within its graph's range of rows; one row's graph specialized): those graphs serve every
        step. S is a multiple of compile()'s key_grain, or by default, for CUDA graphs, which record
        one per (B, S) seen, of 64 (past 512 keys, of an eighth of the next power of two: at most a
        quarter more keys than needed). Eager: B = n and S = end."""
        n, compiled = len(tokens), self.buckets is not None
        B = next(b for b in self.buckets if b >= n) if compiled else n
        grain = self.key_grain or max(64, (1 << (end - 1).bit_length()) // 8)
        S = min(self.cache.room, -(-end // grain) * grain) if compiled else end
        rows = list(range(n)) + [self.cache.rows] * (B - n)
        inputs = [torch.tensor(x + [0] * (B - len(x)), device=self.device) for x in (tokens, rows, positions)]
        inputs.append(self.keys[:S])
        if compiled:
            torch._dynamo.mark_dynamic(inputs[3], 0)
            least, most = next((least, most) for least, most, _ in self.graphs if least <= B <= most)
            for t in inputs[:3] if least < most else []:  # a graph for a range of rows: dynamo's guards tell them apart
                torch._dynamo.mark_dynamic(t, 0, min=least, max=most)
        return inputs

    def _decode(self, tokens, rows, positions, keys):
        """The decoding step: tokens, rows and positions (B,) -> (logits (B, V), their argmax (B,))."""
        cache = Decoding(self.cache, rows, positions, keys, self.fused_attention)
        logits, _ = self.model(tokens[:, None], cache=cache)
        logits = logits[:, -1]
        return logits, logits.argmax(dim=-1)

    def start(self):
        """Run the engine on a thread of its own."""
        self.thread.start()
        return self

    def close(self):
        with self.lock:
            self.closed = True
            self.lock.notify_all()
        if self.thread.ident is not None:  # started: run() on a thread of its own
            self.thread.join()

    def submit(self, request):
        """Queue a request; False when the engine is full (every row busy and the queue long)."""
        with self.lock:
            if self.closed or self.held >= self.rows + self.max_waiting:
                return False
            self.held += 1
            self.queue.append(request)
            self.lock.notify_all()
            return True

    def stats(self):
        """Rows decoding, requests waiting for one (or being prefilled), and decoding steps run."""
        return {
            "active": len(self.active),
            "waiting": self.held - len(self.active),
            "rows": self.rows,
            "steps": self.steps,
        }

    def run(self):
        """Run the engine on this thread until close(). On a CPU, the thread that loaded and compiled
        the model: on a second one, with OpenMP workers of its own, libgomp manages more threads than
        cores, its workers sleep between kernels, and the 124M's step took 1.3-1.5x as long."""
        with torch.inference_mode():  # per thread: set here, not by the caller
            while True:
                with self.lock:
                    while not self.closed and not self.queue and not self.active:
                        self.lock.wait()
                    if self.closed:
                        break
                    new = [self.queue.popleft() for _ in range(min(len(self.queue), self.rows - len(self.active)))]
                self._leave()
                new = [request for request in new if self._guard([request], self._admit, request)]
                if self.active or new:
                    self._guard([*self.active, *new], self._step, new)
                    self._leave()
                self.after_step()
        for request in [*self.active, *self.queue]:
            self._finish(request, "cancelled")
        self.after_step()

    def _guard(self, requests, fn, *args):
        """Run fn; should it fail (a bug, or out of memory), end `requests` with the error and go on
        serving the others."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 (one request's failure must not stop the server)
            traceback.print_exc()
            for request in requests:
                request.finished, request.error = "error", f"{type(e).__name__}: {e}"
                if request not in self.active:  # a failed prefill never took a row
                    self._finish(request, "error")

    def _admit(self, request):
        """True when request is to be prefilled: not cancelled, and it fits the room (ValueError if not)."""
        if request.cancelled:
            self._finish(request, "cancelled")
            return False
        if request.seed is not None or request.temperature > 0:
            seed = request.seed if request.seed is not None else random.SystemRandom().randrange(2**63)
            request.generator = torch.Generator(self.device).manual_seed(seed)
        if not 1 <= len(request.ids) <= len(request.ids) + request.max_tokens - 1 <= self.cache.room:
            raise ValueError(
                f"{len(request.ids)} prompt tokens and {request.max_tokens} new ones do not fit the room "
                f"of {self.cache.room}"
            )
        return True

    def _step(self, new):
        """One forward pass for everything: the next token of every active row, and the prompts of
        the `new` requests (those that arrived since the last step), which join as rows n, n+1, ...
        With prompts, all are packed into one sequence (BatchCache.packed), so a prompt costs its own
        tokens' work (those a free row does not hold already) and no pass of its own. When no prompt
        has more than its last token to run, as when every one is a prompt asked again, or none
        joins, it is the decoding step (self.decode), over a bucket of rows when compiled. Each row's
        logits are read at its last token."""
        n, lengths = len(self.active), self.cache.lengths
        tokens, positions = [r.tokens[-1] for r in self.active], lengths[:n]
        starts = [self.cache.reuse(n + k, r.ids) for k, r in enumerate(new)]  # each into the row that holds most
        if any(len(r.ids) - s > 1 for r, s in zip(new, starts)):
            packed = self.cache.packed(n, [r.ids[s:] for r, s in zip(new, starts)], starts, self.device)
            tokens += [t for r, s in zip(new, starts) for t in r.ids[s:]]
        else:
            tokens, at = tokens + [r.ids[-1] for r in new], positions + starts  # a prompt's last token at its start
            packed, inputs = None, self._inputs(tokens, at, max(at) + 1)
        on_step = self.on_step
        if on_step is not None:
            # the rows the pass computes and the span of keys it reads: the decoding step's are its (B,) and (S,)
            rows, keys = (n + len(new), packed.end) if packed is not None else (len(inputs[0]), len(inputs[3]))
            on_step(Step(list(self.active), positions, list(new), starts, len(tokens), packed is not None, rows, keys))
        if packed is not None:
            logits, _ = self.model(torch.tensor([tokens], device=self.device), cache=packed, logits_at=packed.last)
            greedy = logits.argmax(dim=-1)  # (n + new, V) -> (n + new,)
        else:
            logits, greedy = self.decode(*inputs)
        greedy = greedy.tolist()  # every row's argmax in one read from the device
        for j in range(n):
            lengths[j] += 1
        for request in new:
            lengths[len(self.active)] = len(request.ids)
            self.active.append(request)
        for j, request in enumerate(self.active):
            self._guard([request], self._take, request, logits[j : j + 1], greedy[j])  # a failure here is this row's
        self.steps += 1

    def _take(self, request, logits, greedy=None):
        """The next token of request from its logits (1, V) (greedy: their argmax, when known),
        sampled with its own generator; the request ends at a stop id, a stop string, or max_tokens."""
        if request.temperature == 0:
            token = logits.argmax().item() if greedy is None else greedy
        else:
            token = sample_next(logits, request.temperature, request.top_k, request.top_p, request.generator).item()
        request.generated += 1
        if token in request.stop_ids:
            request.finished = "stop"
        elif request.on_token(token):
            request.finished = "stop"
        elif request.generated >= request.max_tokens:
            request.finished = "length"
        request.tokens.append(token)

    def _leave(self):
        """Free the rows of finished and cancelled requests: each swaps places with the last active row,
        and keeps what it holds (the prompt and the reply but its last token) for a later prompt."""
        j = 0
        while j < len(self.active):
            request = self.active[j]
            if request.finished is None and not request.cancelled:
                j += 1
                continue
            last = len(self.active) - 1
            self.cache.keep(j, (request.ids + request.tokens)[: self.cache.lengths[j]])
            self.cache.swap(j, last)
            self.active[j] = self.active[last]
            self.active.pop()
            self._finish(request, request.finished or "cancelled")

    def _finish(self, request, reason):
        with self.lock:
            self.held -= 1
        request.on_done(reason, request.generated, request.error)
