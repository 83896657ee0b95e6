"""The torch APIs this trainer calls, compared between an older torch wheel and the torch
installed here: for each, its argument names in both (or MISSING), from the Python source, so no
GPU and no import of the old build is needed. How the supported floor (scripts/system_torch.py)
was checked:

    pip download torch==2.11.0 --no-deps --only-binary :all: -d /tmp/torch-floor
    python dev/torch_api_floor.py /tmp/torch-floor/torch-2.11.0-*.whl

Names made by an import, and operators implemented in C++ (scaled_dot_product_attention's
enable_gqa, SDPBackend's members, OutOfMemoryError), are found by their text (the .pyi stubs for
the latter). A name missing from the older torch is reported; exit status 1 then.
"""

import ast
import os
import re
import sys
import zipfile

import torch

APIS = [  # (file under torch/, the name inside it)
    ("distributed/checkpoint/state_dict_loader.py", "_load_state_dict"),
    ("distributed/checkpoint/state_dict_loader.py", "load"),
    ("distributed/checkpoint/state_dict_saver.py", "save"),
    ("distributed/checkpoint/state_dict_saver.py", "async_save"),
    ("distributed/checkpoint/default_planner.py", "_EmptyStateDictLoadPlanner"),
    ("distributed/checkpoint/state_dict.py", "get_state_dict"),
    ("distributed/checkpoint/state_dict.py", "set_state_dict"),
    ("distributed/checkpoint/state_dict.py", "StateDictOptions"),
    ("distributed/checkpoint/filesystem.py", "FileSystemReader.__init__"),
    ("distributed/checkpoint/filesystem.py", "FileSystemReader.read_metadata"),
    ("distributed/checkpoint/metadata.py", "TensorStorageMetadata"),
    ("distributed/checkpoint/metadata.py", "TensorProperties"),
    ("distributed/checkpoint/api.py", "CheckpointException.__init__"),
    ("distributed/fsdp/_fully_shard/_fully_shard.py", "fully_shard"),
    ("distributed/fsdp/_fully_shard/_fsdp_api.py", "MixedPrecisionPolicy"),
    ("nn/attention/__init__.py", "sdpa_kernel"),
    ("nn/utils/clip_grad.py", "_get_total_norm"),
    ("nn/utils/clip_grad.py", "_clip_grads_with_norm_"),
    ("nn/modules/normalization.py", "RMSNorm.__init__"),
    ("nn/functional.py", "rms_norm"),
    ("nn/parallel/distributed.py", "DistributedDataParallel.__init__"),
    ("optim/_muon.py", "Muon.__init__"),
    ("optim/adamw.py", "AdamW.__init__"),
    ("amp/grad_scaler.py", "GradScaler.__init__"),
    ("amp/autocast_mode.py", "autocast.__init__"),
    ("serialization.py", "load"),
    ("random.py", "fork_rng"),
    ("mps/__init__.py", "get_rng_state"),
    ("mps/__init__.py", "set_rng_state"),
    ("mps/__init__.py", "synchronize"),
    ("backends/mps/__init__.py", "is_macos_or_newer"),
    ("cuda/__init__.py", "set_sync_debug_mode"),
    ("cuda/random.py", "get_rng_state"),
    ("cuda/random.py", "set_rng_state"),
    ("utils/checkpoint.py", "checkpoint"),
    ("autograd/graph.py", "saved_tensors_hooks.__init__"),
    ("__init__.py", "compile"),
    ("_dynamo/eval_frame.py", "OptimizedModule"),
    ("_dynamo/__init__.py", "reset"),
    ("_subclasses/fake_tensor.py", "FakeTensorMode.__init__"),
    ("_subclasses/fake_tensor.py", "FakeTensorDeviceMismatchError"),  # tests only; they fall back to RuntimeError
    ("utils/tensorboard/writer.py", "SummaryWriter.__init__"),
    ("profiler/profiler.py", "profile.__init__"),
    ("profiler/profiler.py", "schedule"),
    ("profiler/profiler.py", "tensorboard_trace_handler"),
]

TEXTS = [  # (file under torch/, a regular expression its text must match): names made by import or in stubs
    ("distributed/checkpoint/format_utils.py", r"_EmptyStateDictLoadPlanner,"),
    ("distributed/device_mesh.py", r"def init_device_mesh\("),
    ("distributed/fsdp/__init__.py", r"fully_shard,"),
    ("nn/utils/__init__.py", r"_get_total_norm as get_total_norm"),
    ("nn/utils/__init__.py", r"_clip_grads_with_norm_ as clip_grads_with_norm_"),
    ("optim/__init__.py", r"from torch.optim._muon import Muon"),
    ("_C/_VariableFunctions.pyi", r"enable_gqa: _bool"),
    ("_C/__init__.pyi", r"CUDNN_ATTENTION = "),
    ("_C/__init__.pyi", r"class OutOfMemoryError"),
]


def find(tree, qual):
    node = tree
    for part in qual.split("."):
        node = next(
            (
                n
                for n in ast.iter_child_nodes(node)
                if getattr(n, "name", None) == part
                and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            ),
            None,
        )
        if node is None:
            return None
    return node


def signature(text, qual):
    node = find(ast.parse(text), qual) if text is not None else None
    if node is None:
        return "MISSING"
    if isinstance(node, ast.ClassDef):  # a dataclass: its fields
        return (
            "("
            + ", ".join(
                t.target.id for t in node.body if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)
            )
            + ")"
        )
    a = node.args
    return (
        "("
        + ", ".join(
            [x.arg for x in a.posonlyargs + a.args]
            + (["*" + a.vararg.arg] if a.vararg else [])
            + [x.arg for x in a.kwonlyargs]
        )
        + ")"
    )


def main(wheel):
    here = os.path.dirname(torch.__file__)
    old = zipfile.ZipFile(wheel)
    names = set(old.namelist())
    read_old = lambda path: old.read(f"torch/{path}").decode() if f"torch/{path}" in names else None
    read_new = lambda path: open(os.path.join(here, path)).read() if os.path.exists(os.path.join(here, path)) else None
    version = re.search(r"torch-([^-]+)-", os.path.basename(wheel)).group(1)
    missing = 0
    for path, qual in APIS:
        a, b = signature(read_old(path), qual), signature(read_new(path), qual)
        missing += a == "MISSING"
        print(
            f"{'same' if a == b else 'DIFF'}  torch/{path}:{qual}  {version}{a}"
            + ("" if a == b else f"  {torch.__version__}{b}")
        )
    for path, pattern in TEXTS:
        found = read_old(path) is not None and re.search(pattern, read_old(path)) is not None
        missing += not found
        print(f"{'same' if found else 'MISSING'}  torch/{path}: {pattern}")
    print(f"{missing} of {len(APIS) + len(TEXTS)} missing in torch {version}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
