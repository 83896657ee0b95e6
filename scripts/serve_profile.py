"""Where a step of serve.py's engine spends its time: torch.profiler over the engine's own step
(engine.Engine._step), a prompt's prefill and then decoding steps of --rows rows, each op's time
put under one heading, and what is left of the step's wall time (Python, dispatch, waits).

    python scripts/serve_profile.py --out_dir=out-gpt2-124m-random --rows=1,16
    python scripts/serve_profile.py --out_dir=out-gpt2-124m-random --rows=1,16 --compile   # serve.py --compile's step, kernels called from Python
    python scripts/serve_profile.py --out_dir=out-gpt2-124m-random --dtype=bfloat16 --compile
    python scripts/serve_profile.py --out_dir=out-gpt2-124m-random --threads=1 --trace=step.json   # for Perfetto
    python scripts/serve_profile.py --out_dir=out-gpt2-124m-random --baseline=../before            # another checkout's

The rows are filled first, each with a prompt of --prompt tokens, then --steps decoding steps are
profiled (after --warmup unprofiled ones). Headings, by op name (a compiled step's fused kernels are
`cpp_fused_...`, its matmuls inductor's C++ GEMM kernels `..._gemm_...`, Triton's `triton_...`, and an
op's time is its own, not its callees'):

    matmuls          aten::mm, addmm, linear and their MKL/oneDNN forms, but the lm_head's
    lm_head          the matmul whose output has the vocabulary's width
    attention        scaled_dot_product_attention's kernels, and the fused kernels that hold them or a softmax
                     (a compiled CPU step's attention, with the cache write and the bias before it)
    cache writes     index_put_ into the key/value cache
    other ops        norms, GELU, additions, embedding lookups, argmax, copies, fused elementwise kernels
    Python/dispatch  the step's wall time less all of the above: Python, the dispatcher, host waits

--rows of one prompt's prefill is reported too (a step with a prompt joining is one eager pass).
"""

import argparse
import collections
import importlib.util
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from configurator import run_main  # after the path line above

HEADINGS = ["matmuls", "lm_head", "attention", "cache writes", "other ops", "Python/dispatch"]


def heading(event, vocab):
    name = event.key.lower()
    if any(word in name for word in ("attention", "sdpa", "flash", "softmax")):  # a compiled CPU step's: fused loops
        return "attention"
    if any(word in name for word in ("::mm", "addmm", "linear", "mkl", "bmm", "matmul", "gemm")):
        # an op's shapes, or a C++ GEMM kernel's name, which gives its n and k: gemm_..n50304k768_..
        shapes = [s for s in event.input_shapes if s]
        return "lm_head" if any(vocab in s for s in shapes) or f"n{vocab}k" in name else "matmuls"
    if "index_put" in name:
        return "cache writes"
    return "other ops"


def fill(engine, rows, prompt, request_class):
    """rows requests (of request_class, the engine's own) of `prompt` ids each, prefilled into rows
    0..rows-1 (one packed step), which then are the engine's active requests."""
    requests = [
        request_class(list(prompt), 10**9, lambda token: False, lambda *end: None, temperature=0) for _ in range(rows)
    ]
    engine._step(requests)
    return requests


def profiled(fn, steps, vocab):
    """({heading: ms per step}, wall ms per step) of fn() run `steps` times under the profiler."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        wall = 1000 * (time.perf_counter() - start) / steps
    times = collections.Counter()
    for event in prof.key_averages(group_by_input_shape=True):
        if event.key.startswith(("ProfilerStep", "Torch-Compiled Region", "CompiledFunction", "##")):
            continue
        times[heading(event, vocab)] += event.self_cpu_time_total / 1000 / steps
    times["Python/dispatch"] = max(0.0, wall - sum(times.values()))
    return times, wall, prof


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="out-gpt2-124m-random", help="the checkpoint (default: %(default)s)")
    p.add_argument("--rows", default="1,16", help="rows decoding together, one profile each (default: %(default)s)")
    p.add_argument("--prompt", type=int, default=40, help="prompt tokens per row (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="decoding steps profiled (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=5, help="decoding steps run first (default: %(default)s)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="the engine's compiled decoding step (serve.py --compile, with inductor's Python wrapper: the profiler sees each op)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=0, help="torch's threads (0: its default, every core)")
    p.add_argument("--trace", help="also write the last profile's Chrome trace here")
    p.add_argument("--baseline", help="profile the engine of this checkout instead (eager: a commit before a change)")
    args = p.parse_args(argv)
    sys.path.insert(0, args.baseline or str(REPO))
    from gpt.device import runtime  # this checkout's, or --baseline's
    from gpt.weights import load

    try:
        from gpt.inference.engine import Engine, Request, compile_options
    except ImportError:  # a --baseline from before engine.py: the engine was inference.py's
        from gpt.inference.sampling import Engine, Request, compile_options

    if args.threads:
        torch.set_num_threads(args.threads)
    levels = [int(r) for r in args.rows.split(",")]
    model, _ = load.for_inference("resume", args.out_dir, report=lambda line: None)
    model.eval().to(dtype=runtime.DTYPES[args.dtype])
    if importlib.util.find_spec("gpt.device.cpu_matmuls"):  # serve.py's eager matmuls (a --baseline may predate them)
        importlib.import_module("gpt.device.cpu_matmuls").onednn_matmuls(model)
    vocab = model.config.padded_vocab_size
    engine = Engine(model, rows=max(levels), room=min(model.config.block_size, 1024))
    if args.compile:
        # serve.py's settings (compile_options) but inductor's Python wrapper, each C++ kernel
        # recorded (serve.py's cpp_wrapper calls them where the profiler sees only the step's wall); a
        # --baseline from before compile_options had inductor settings compiles as it did
        settings = {key: value for key, value in compile_options("cpu").items() if key != "options"}
        kernels = {"cpp.enable_kernel_profile": True}
        if "graphs" in settings:
            settings["graphs"] = [(most, {**(graph or {}), **kernels}) for most, graph in settings["graphs"]]
        else:  # a --baseline's: inductor= and inductor_rows=
            settings.update(
                {key: {**value, **kernels} for key, value in settings.items() if key.startswith("inductor")}
            )
        error = engine.compile(**settings)
        if error:
            print(f"torch.compile failed: {error}", file=sys.stderr)
            return 1
    prompt = [i % model.config.vocab_size for i in range(1000, 1000 + args.prompt)]
    rows = {}
    with torch.inference_mode():
        engine.cache.lengths = [0] * engine.rows
        times, wall, _ = profiled(lambda: (engine.active.clear(), fill(engine, 1, prompt, Request)), 3, vocab)
        rows["prefill"] = (times, wall)
        for n in levels:
            engine.active.clear()
            fill(engine, n, prompt, Request)
            for _ in range(args.warmup):
                engine._step([])
            times, wall, prof = profiled(lambda: engine._step([]), args.steps, vocab)
            rows[f"{n} rows"] = (times, wall)
    if args.trace:
        prof.export_chrome_trace(args.trace)
    what = f"{'compiled' if args.compile else 'eager'}, {args.dtype}, {torch.get_num_threads()} threads"
    print(f"ms per step ({what}; prefill: one {args.prompt}-token prompt)\n")
    print("| step | wall | " + " | ".join(HEADINGS) + " |")
    print("|---|---:|" + "---:|" * len(HEADINGS))
    for name, (times, wall) in rows.items():
        print(f"| {name} | {wall:.1f} | " + " | ".join(f"{times[h]:.1f}" for h in HEADINGS) + " |")
    return 0


if __name__ == "__main__":
    run_main(main)
