"""The host memory this job may still use: the host's MemAvailable, lowered to what the tightest
memory limit of its cgroup leaves (cgroup v2 and v1, the process's group and its ancestors)."""

import os

# where free_memory reads the host's and the cgroup's numbers (the tests point these at fake files)
MEMINFO, SELF_CGROUP, CGROUP_ROOT = "/proc/meminfo", "/proc/self/cgroup", "/sys/fs/cgroup"


def free_memory():
    """Bytes of host memory this process may still take: the host's MemAvailable, lowered to what
    the tightest memory limit of its cgroup leaves (a Slurm job's, a Kubernetes pod's). Past that
    limit the kernel kills the job (exit -9, no message), however much the host has free."""
    host, left = _mem_available(), cgroup_memory_left()
    return host if left is None else min(host, left)


def _mem_available():
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB; free pages plus the cache the kernel can drop
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # no /proc/meminfo (macOS): free pages
    except (ValueError, OSError, AttributeError):
        return 0  # unknown: stay with the memmap


# (limit, usage, the memory.stat key of reclaimable page cache) per cgroup version
CGROUP_FILES = {
    "v2": ("memory.max", "memory.current", "inactive_file"),
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


def cgroup_memory_left():
    """Bytes left under the tightest memory limit of this process's cgroup and its ancestors (a
    limit anywhere above applies too: Slurm sets it on the job, the process sits in a step below),
    in cgroup v2 or v1; None when no limit is set or nothing can be read. The inactive page cache
    counts as left: the kernel drops it before it kills."""
    try:
        with open(SELF_CGROUP) as f:
            lines = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    lefts = []
    for _, controllers, path in lines:
        if controllers == "":  # v2 (on a hybrid host its hierarchy is mounted at unified/)
            mounts, files = [CGROUP_ROOT, os.path.join(CGROUP_ROOT, "unified")], CGROUP_FILES["v2"]
        elif "memory" in controllers.split(","):
            mounts, files = [os.path.join(CGROUP_ROOT, "memory")], CGROUP_FILES["v1"]
        else:
            continue
        for mount in mounts:
            # the group and its ancestors; in a container whose mount is its own group, only the mount exists
            parts = [p for p in path.split("/") if p]
            for depth in range(len(parts), -1, -1):
                left = _cgroup_left(os.path.join(mount, *parts[:depth]), *files)
                if left is not None:
                    lefts.append(left)
    return min(lefts) if lefts else None


def _cgroup_left(group, limit_file, usage_file, inactive_key):
    try:
        with open(os.path.join(group, limit_file)) as f:
            limit = f.read().strip()
        if limit == "max" or int(limit) >= 1 << 60:  # v2's "no limit", v1's (PAGE_COUNTER_MAX pages)
            return None
        with open(os.path.join(group, usage_file)) as f:
            usage = int(f.read())
    except (OSError, ValueError):
        return None
    inactive = 0
    try:
        with open(os.path.join(group, "memory.stat")) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
    except (OSError, ValueError):
        pass
    return max(0, int(limit) - usage + inactive)
