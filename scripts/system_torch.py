"""Does the Python running this already have a GPU build of torch that `make` should keep? Yes
for a CUDA (or ROCm) build at or above the supported floor: it came with the machine, matched to
its driver, and reinstalling would download gigabytes or bring a build the driver cannot run.
Prints its version and exits 0; otherwise says why on stderr and exits 1, and make installs
the torch pinned in requirements.txt.

    python3 scripts/system_torch.py && echo "keep it"
"""

import re
import sys

FLOOR = (
    2,
    11,
)  # the oldest torch whose every API this trainer calls was checked (docs/install.md, "Which torch versions work")


def decide():
    """(version to keep or None, the reason in words)."""
    try:
        import torch
    except Exception as e:  # none installed, or one that cannot load
        return None, f"no torch importable here ({type(e).__name__}: {e})"
    version = str(getattr(torch, "__version__", "?"))
    gpu = (
        getattr(torch.version, "cuda", None)
        and f"CUDA {torch.version.cuda}"
        or getattr(torch.version, "hip", None)
        and f"ROCm {torch.version.hip}"
    )
    m = re.match(r"(\d+)\.(\d+)", version)
    floor = ".".join(map(str, FLOOR))
    if not gpu:
        return None, f"torch {version} here is not a GPU build"
    if not m or tuple(map(int, m.groups())) < FLOOR:
        return None, f"torch {version} ({gpu}) here is older than the supported {floor}"
    return version, f"torch {version} ({gpu}) here is at or above the supported {floor}"


def main():
    version, reason = decide()
    print(f"{reason}: {'keeping it' if version else 'installing the pinned torch'}", file=sys.stderr)
    if version:
        print(version)
    return 0 if version else 1


if __name__ == "__main__":
    sys.exit(main())
