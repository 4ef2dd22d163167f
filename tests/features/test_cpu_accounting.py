"""Cores available from the affinity mask and the cgroup CPU quota, on fake cgroup trees."""

from __future__ import annotations

import os

from leanml.machine import cores_available


def _write(root, rel, text):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def test_cgroup_v2_quota_of_the_process_and_its_ancestors(tmp_path):
    _write(tmp_path, "proc/self/cgroup", "0::/jobs/bench\n")
    _write(tmp_path, "sys/fs/cgroup/cpu.max", "max 100000\n")
    _write(tmp_path, "sys/fs/cgroup/jobs/cpu.max", "150000 100000\n")  # the parent allows 1.5 cores
    _write(tmp_path, "sys/fs/cgroup/jobs/bench/cpu.max", "max 100000\n")
    c = cores_available(tmp_path)
    assert c["quota"] == 1.5 and c["quota_file"].endswith("jobs/cpu.max")
    assert c["cores"] == min(1.5, c["affinity"])


def test_cgroup_v1_quota_and_unlimited(tmp_path):
    _write(tmp_path, "proc/self/cgroup", "4:memory:/x\n3:cpu,cpuacct:/ci\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/ci/cpu.cfs_quota_us", "50000\n")
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/ci/cpu.cfs_period_us", "100000\n")
    assert cores_available(tmp_path)["cores"] == 0.5
    _write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/ci/cpu.cfs_quota_us", "-1\n")
    c = cores_available(tmp_path)
    assert c["quota"] is None and c["cores"] == float(os.cpu_count())


def test_this_machine():
    c = cores_available()
    assert 0 < c["cores"] <= c["affinity"] <= c["cpu_count"]
    assert c["affinity"] == len(os.sched_getaffinity(0))
