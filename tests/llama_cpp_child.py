"""llama.cpp's side of tests/test_gguf.py, in a process of its own (test_gguf.llama_cpp): native code
can die of a signal, and in a child that is one failed test that names it. It imports only llama_cpp
and numpy, so it starts in a fraction of a second.

    python tests/llama_cpp_child.py FUNCTION ARGS RESULT   # FUNCTION(*args), args and result pickled files

On CPUs with AMX (`amx_int8` in /proc/cpuinfo) llama.cpp's AMX matrix multiply crashes on q8_0
files (docs/gguf.md); `load` then sets use_extra_bufts=False (llama-server's --no-repack), which
llama-cpp-python's Llama has no argument for, on the model parameters it starts from."""

import contextlib
import itertools
import pickle
import sys

F32 = 0  # GGML_TYPE_F32: llama.cpp's key/value cache in float32 (its default is f16)


def cpu_has_amx():
    """gpt/weights/gguf_export.cpu_has_amx's test, here so that a child imports no torch."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "amx_int8" in line.split(":", 1)[-1].split() for line in f)
    except OSError:
        return False


@contextlib.contextmanager
def no_extra_buffer_types():
    """llama-cpp-python's Llama with use_extra_bufts=False: no weight repacking, no AMX buffer."""
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params

    def without_extra():
        params = default()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = without_extra
    try:
        yield
    finally:
        lib.llama_model_default_params = default


def load(path, no_repack=None, **kwargs):
    """A Llama on one thread; no_repack None: the workaround where the CPU needs it (AMX)."""
    import llama_cpp

    no_repack = cpu_has_amx() if no_repack is None else no_repack
    with no_extra_buffer_types() if no_repack else contextlib.nullcontext():
        return llama_cpp.Llama(model_path=str(path), n_threads=1, n_threads_batch=1, verbose=False, **kwargs)


def tokenize(path, texts, special=True):
    """{metadata, bos, eos, ids: [llama.cpp's ids of each text]} from a vocab-only load."""
    llm = load(path, vocab_only=True)
    return {
        "metadata": dict(llm.metadata),
        "bos": llm.token_bos(),
        "eos": llm.token_eos(),
        "ids": [llm.tokenize(t.encode("utf-8"), add_bos=False, special=special) for t in texts],
    }


def rendered(llm, conversations, eos_token, bos_token):
    """The GGUF's chat template rendered by llama-cpp-python for each message list, then tokenized."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = llm.metadata["tokenizer.chat_template"]
    render = Jinja2ChatFormatter(template=template, eos_token=eos_token, bos_token=bos_token)
    return [llm.tokenize(render(messages=m).prompt.encode("utf-8"), add_bos=False, special=True) for m in conversations]


def render_and_tokenize(path, conversations, eos_token="", bos_token=""):
    return rendered(load(path, vocab_only=True), conversations, eos_token, bos_token)


def scores_and_greedy(path, ids, prompt, n_ctx, n=64, no_repack=None):
    """(logits at every position of ids as a (len(ids), n_vocab) array, n greedy tokens after prompt)."""
    import numpy as np

    llm = load(path, no_repack=no_repack, n_ctx=n_ctx, logits_all=True, type_k=F32, type_v=F32)
    llm.eval(ids)
    scores = np.array(llm.scores[: len(ids)])
    greedy = list(itertools.islice(llm.generate(prompt, temp=0.0, repeat_penalty=1.0), n))
    return scores, greedy


def chat_replies(path, conversations, n_ctx=128):
    """{metadata, eos, prompts: the rendered prompts' ids, replies: create_chat_completion at temperature 0}."""
    llm = load(path, n_ctx=n_ctx, type_k=F32, type_v=F32)
    prompts = rendered(llm, conversations, "<|end|>", "<|endoftext|>")
    replies = [
        llm.create_chat_completion(m, temperature=0.0, repeat_penalty=1.0)["choices"][0]["message"]["content"]
        for m in conversations
    ]
    return {"metadata": dict(llm.metadata), "eos": llm.token_eos(), "prompts": prompts, "replies": replies}


if __name__ == "__main__":
    function, args, result = sys.argv[1:]
    with open(args, "rb") as f:
        value = globals()[function](*pickle.load(f))
    with open(result, "wb") as f:
        pickle.dump(value, f)
