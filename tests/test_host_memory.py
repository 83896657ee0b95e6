"""The host memory a job may use (host_memory.free_memory), and whether load_split reads a split into
RAM by it. A Slurm job or a Kubernetes pod is killed (exit -9, no message) past its cgroup's limit,
however much the host has free: cgroup v2 and v1, the process's group and its ancestors, read from a
fake /proc and /sys/fs/cgroup in a temporary directory."""

import numpy as np
import pytest

import train
from configurator import TrainConfig, UserError
from gpt.data import token_files
from gpt.data.batches import load_split
from gpt.device import host_memory

GiB, MiB = 1 << 30, 1 << 20
V1_NO_LIMIT = 9223372036854771712  # what v1's memory.limit_in_bytes reads when nothing is set
IDS = (np.arange(MiB // 2) % 50257).astype(np.uint16)  # 1 MiB of GPT-2 token ids


@pytest.fixture
def host(tmp_path, monkeypatch):
    """A fake machine: host(available, cgroup_lines, groups) writes /proc/meminfo's MemAvailable,
    /proc/self/cgroup's lines, and {relative dir under the cgroup root: {file: content}}."""

    def make(available, cgroup_lines, groups=None):
        kb = dict(MemTotal=2 * available // 1024, MemFree=available // 2048, MemAvailable=available // 1024)
        (tmp_path / "meminfo").write_text("".join(f"{key}:{n:>15} kB\n" for key, n in kb.items()))
        (tmp_path / "self_cgroup").write_text("".join(line + "\n" for line in cgroup_lines))
        for group, files in (groups or {}).items():
            d = tmp_path / "cgroup" / group
            d.mkdir(parents=True, exist_ok=True)
            for name, content in files.items():
                (d / name).write_text(str(content) + "\n")

    monkeypatch.setattr(host_memory, "MEMINFO", str(tmp_path / "meminfo"))
    monkeypatch.setattr(host_memory, "SELF_CGROUP", str(tmp_path / "self_cgroup"))
    monkeypatch.setattr(host_memory, "CGROUP_ROOT", str(tmp_path / "cgroup"))
    return make


def v2(limit, usage, inactive=0):
    stat = f"anon {usage - inactive}\ninactive_file {inactive}"
    return {"memory.max": limit, "memory.current": usage, "memory.stat": stat}


def v1(limit, usage, inactive=0):
    stat = f"inactive_file 0\ntotal_rss {usage - inactive}\ntotal_inactive_file {inactive}"
    return {"memory.limit_in_bytes": limit, "memory.usage_in_bytes": usage, "memory.stat": stat}


def test_a_v2_limit_on_an_ancestor_group_bounds_free_memory(host):
    # Slurm: the limit is on the job, the process runs in a step below it (no limit of its own)
    job = "system.slice/slurmstepd.scope/job_42"
    groups = {"": v2("max", 20 * GiB), job: v2(8 * GiB, 3 * GiB, inactive=1 * GiB), f"{job}/step_0": v2("max", 2 * GiB)}
    host(64 * GiB, [f"0::/{job}/step_0"], groups)
    assert host_memory.cgroup_memory_left() == 6 * GiB  # 8 - 3 used + 1 of page cache the kernel drops first
    assert host_memory.free_memory() == 6 * GiB


def test_a_v1_memory_limit_bounds_free_memory(host):
    job = v1(16 * GiB, 10 * GiB, inactive=2 * GiB)
    groups = {"memory": v1(V1_NO_LIMIT, 30 * GiB), "memory/slurm/uid_0/job_7": job, "": v2("max", 0)}
    host(64 * GiB, ["5:cpu,cpuacct:/slurm/uid_0/job_7", "4:memory:/slurm/uid_0/job_7", "0::/"], groups)
    assert host_memory.free_memory() == 8 * GiB


def test_a_container_sees_its_own_group_at_the_mount(host):
    # cgroup v2 namespaced (Docker, Kubernetes): /proc/self/cgroup says "/", the mount is the pod's group
    host(64 * GiB, ["0::/"], {"": v2(4 * GiB, 1 * GiB)})
    assert host_memory.free_memory() == 3 * GiB
    # v1 without a namespace: /proc/self/cgroup names a path the container's mount does not have
    host(64 * GiB, ["4:memory:/kubepods/burstable/pod1/abc"], {"memory": v1(2 * GiB, 1 * GiB)})
    assert host_memory.free_memory() == 1 * GiB


def test_the_host_bounds_free_memory_when_no_cgroup_limits_it(host):
    groups = {"memory/user.slice": v1(V1_NO_LIMIT, 1 * GiB), "user.slice": v2("max", 1 * GiB)}
    host(5 * GiB, ["4:memory:/user.slice", "0::/user.slice"], groups)
    assert host_memory.cgroup_memory_left() is None
    assert host_memory.free_memory() == 5 * GiB
    host(1 * GiB, ["0::/"], {"": v2(8 * GiB, 1 * GiB)})  # a limit looser than what the host has free
    assert host_memory.free_memory() == 1 * GiB


@pytest.fixture
def split_1mib(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    token_files.write(str(data_dir / "train.bin"), IDS)
    (data_dir / "val.bin").write_bytes((data_dir / "train.bin").read_bytes())
    return data_dir


@pytest.mark.parametrize(
    "left, share, in_ram",
    [
        (64 * MiB, 1, True),
        (64 * MiB, 8, True),  # 8 copies are 8 MiB, under a quarter of 64
        (64 * MiB, 32, False),  # 32 copies are 32 MiB, past a quarter: the ranks share the memmap
        (2 * MiB, 1, False),  # the host has 64 GiB free, but the job may only take 2 MiB more
    ],
)
def test_auto_reads_a_split_into_ram_only_within_the_jobs_limit(host, split_1mib, left, share, in_ram):
    host(64 * GiB, ["0::/job"], {"job": v2(left + 100 * MiB, 100 * MiB)})
    data = load_split(str(split_1mib), "train", "auto", share)
    assert data.memmapped != in_ram
    np.testing.assert_array_equal(np.asarray(data), IDS)


def test_train_holds_one_copy_per_local_rank_within_the_limit(host, split_1mib, monkeypatch):
    # 8 ranks on this machine, a limit that one copy of each split fits in but eight do not
    host(64 * GiB, ["0::/job"], {"job": v2(20 * MiB, 4 * MiB)})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    data = train.load_data(TrainConfig(dataset=str(split_1mib), block_size=64), print)
    assert data.train.memmapped and data.val.memmapped
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    data = train.load_data(TrainConfig(dataset=str(split_1mib), block_size=64), print)
    assert not data.train.memmapped


def test_ram_mode_past_the_limit_is_one_line(host, split_1mib):
    host(64 * GiB, ["0::/job"], {"job": v2(5 * MiB, 1 * MiB)})
    with pytest.raises(UserError) as e:
        load_split(str(split_1mib), "train", "ram", share=8)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(
        "data_mode='ram' needs 8 MiB for train (8 rank(s) x 1 MiB) but this job may use 4 MiB more"
    )
    assert "--data_mode=memmap" in str(e.value)
    assert not load_split(str(split_1mib), "train", "ram", share=1).memmapped  # one copy fits
