"""`make quickstart` and `make test` keep a machine's own GPU build of torch: the decision
(scripts/system_torch.py, run against fake torch packages that report a version and a CUDA or
ROCm build) and what the Makefile then runs (with a stand-in python that records its calls
instead of creating a venv and downloading packages)."""

import shutil
import stat
import sys

import pytest
from processes import REPO, run, run_python

pytestmark = pytest.mark.process  # every test here starts a process


def fake_torch(root, version, cuda=None, hip=None, broken=False):
    """root/torch: a package that imports as torch `version` built for `cuda` or `hip` (None: CPU)."""
    pkg = root / "torch"
    pkg.mkdir(parents=True)
    if broken:  # a CUDA build whose libraries cannot load
        (pkg / "__init__.py").write_text('raise OSError("libcudnn.so.9: cannot open shared object file")\n')
        return root
    (pkg / "__init__.py").write_text(f"from . import version\n__version__ = {version!r}\n")
    (pkg / "version.py").write_text(f"__version__ = {version!r}\ncuda = {cuda!r}\nhip = {hip!r}\n")
    return root


def decide(tmp_path, **torch):
    return run_python(
        ["scripts/system_torch.py"], env={"PYTHONPATH": str(fake_torch(tmp_path / "site", **torch))}, timeout=60
    )


@pytest.mark.parametrize(
    "torch, kept, reason",
    [
        (
            dict(version="2.11.0+cu130", cuda="13.0"),
            True,
            "torch 2.11.0+cu130 (CUDA 13.0) here is at or above the supported 2.11: keeping it",
        ),
        (
            dict(version="2.12.1+rocm7.1", hip="7.1.25424"),
            True,
            "torch 2.12.1+rocm7.1 (ROCm 7.1.25424) here is at or above the supported 2.11: keeping it",
        ),
        (
            dict(version="2.10.0+cu128", cuda="12.8"),
            False,
            "torch 2.10.0+cu128 (CUDA 12.8) here is older than the supported 2.11: installing the pinned torch",
        ),
        (dict(version="2.13.0+cpu"), False, "torch 2.13.0+cpu here is not a GPU build: installing the pinned torch"),
        (
            dict(version="2.11.0", broken=True),
            False,
            "no torch importable here (OSError: libcudnn.so.9: cannot open shared object file): installing the pinned torch",
        ),
    ],
)
def test_a_gpu_torch_at_or_above_the_floor_is_kept(tmp_path, torch, kept, reason):
    result = decide(tmp_path, **torch)
    assert result.returncode == (0 if kept else 1)
    assert result.stdout == (torch["version"] + "\n" if kept else "")
    assert result.stderr.strip() == reason


RECORDER = """#!/bin/sh
# records how make called python; `-m venv DIR` makes DIR/bin/python this same recorder
echo "$0 $*" >> {log}
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
    for dir; do :; done
    mkdir -p "$dir/bin" && cp "$0" "$dir/bin/python"
    exit 0
fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
    exit 0
fi
exec {python} "$@"
"""


def make_venv(tmp_path, *args, target="venv", **torch):
    """`make venv` (or `target`) into tmp_path/.venv with python3 a recorder over this interpreter,
    on a machine whose torch is the fake one; returns (the recorded calls, the venv, make's stdout)."""
    log, venv, recorder = tmp_path / "calls.log", tmp_path / ".venv", tmp_path / "bin" / "python3"
    recorder.parent.mkdir(exist_ok=True)  # a second call makes on the first one's venv
    recorder.write_text(RECORDER.format(log=log, python=sys.executable))
    recorder.chmod(recorder.stat().st_mode | stat.S_IXUSR)
    site = tmp_path / "site"
    env = {"PYTHONPATH": str(site if site.exists() else fake_torch(site, **torch))}
    result = run(["make", "-C", REPO, target, f"PYTHON={recorder}", f"VENV={venv}", *args], env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    calls = [line.replace(str(tmp_path), "TMP").replace(str(REPO), "REPO") for line in log.read_text().splitlines()]
    log.unlink()
    return calls, venv, result.stdout


needs_make = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


@needs_make
def test_make_keeps_the_machines_cuda_torch(tmp_path):
    calls, venv, _ = make_venv(tmp_path, version="2.11.0+cu130", cuda="13.0")
    assert calls == [
        "TMP/bin/python3 scripts/system_torch.py",
        "TMP/bin/python3 -m venv --system-site-packages TMP/.venv",
        "TMP/.venv/bin/python -m pip install --quiet --upgrade pip",
        "TMP/.venv/bin/python -m pip install -c TMP/.venv/keep-torch.txt -r TMP/.venv/requirements-without-torch.txt",
    ]
    assert (venv / "keep-torch.txt").read_text() == "torch==2.11.0+cu130\n"
    requirements = (REPO / "requirements.txt").read_text().splitlines()
    kept = (venv / "requirements-without-torch.txt").read_text().splitlines()
    assert [line for line in requirements if line not in kept] == ["torch==2.13.0"]  # only torch left out
    assert (venv / ".installed").exists()


@needs_make
@pytest.mark.parametrize(
    "torch, args", [(dict(version="2.13.0+cpu"), ()), (dict(version="2.11.0+cu130", cuda="13.0"), ("SYSTEM_TORCH=no",))]
)
def test_make_installs_the_pinned_torch_elsewhere(tmp_path, torch, args):
    calls, _, _ = make_venv(tmp_path, *args, **torch)
    assert calls == (["TMP/bin/python3 scripts/system_torch.py"] if not args else []) + [
        "TMP/bin/python3 -m venv TMP/.venv",
        "TMP/.venv/bin/python -m pip install --quiet --upgrade pip",
        "TMP/.venv/bin/python -m pip install -r requirements.txt",
    ]


@needs_make
@pytest.mark.parametrize(
    "torch, size",
    [(dict(version="2.13.0+cpu"), "about 1.9 GB"), (dict(version="2.11.0+cu130", cuda="13.0"), "about 1.1 GB")],
)
def test_running_gets_the_runtime_packages_and_testing_adds_its_own(tmp_path, torch, size):
    """make quickstart's venv (`make venv`) holds requirements.txt only, and says what and about how
    much it installs, with pip's progress shown (no --quiet); make test's (`make venv-dev`) adds
    requirements-dev.txt on top, under a constraint that keeps the venv's torch."""
    calls, venv, said = make_venv(tmp_path, **torch)
    assert not [call for call in calls if "requirements-dev" in call]
    assert [call for call in calls if "install" in call and "--quiet" in call] == [
        "TMP/.venv/bin/python -m pip install --quiet --upgrade pip"
    ]
    assert "make: installing what running needs (requirements.txt" in said and size in said
    calls, _, said = make_venv(tmp_path, target="venv-dev", **torch)  # on the venv just made
    assert calls[-2:] == [
        """TMP/.venv/bin/python -c import torch; print('torch==' + torch.__version__)""",
        "TMP/.venv/bin/python -m pip install -c TMP/.venv/keep-torch.txt -r requirements-dev.txt",
    ]
    assert (venv / "keep-torch.txt").read_text() == f"torch=={torch['version']}\n"
    assert "make: adding the test tools (requirements-dev.txt" in said
    assert (venv / ".installed-dev").exists()
