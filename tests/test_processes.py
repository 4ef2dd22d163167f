"""leanml.processes: ``run_child`` -- a killed parent takes its child's whole process group with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leanml.processes import run_child

PARENT = """
import sys
from leanml.processes import exit_on_sigterm, run_child
exit_on_sigterm()
# the child starts a grandchild (as flock starts its command) and both sleep
run_child(["sh", "-c", "sleep 60 & echo $! > {pids}; echo $$ >> {pids}; wait"])
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:  # a zombie is dead
        return fh.read().split(")")[-1].split()[0] != "Z"


def test_sigterm_to_the_parent_stops_child_and_grandchild(tmp_path: Path):
    pids = tmp_path / "pids"
    script = tmp_path / "parent.py"
    script.write_text(PARENT.format(pids=pids))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen([sys.executable, str(script)], env=env)
    for _ in range(200):
        if pids.exists() and len(pids.read_text().split()) == 2:
            break
        time.sleep(0.05)
    grandchild, child = (int(x) for x in pids.read_text().split())
    assert _alive(child) and _alive(grandchild)
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 128 + signal.SIGTERM
    deadline = time.time() + 15
    while (_alive(child) or _alive(grandchild)) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(child) and not _alive(grandchild)


def test_exit_codes():
    assert run_child([sys.executable, "-c", "pass"]) == 0
    assert run_child([sys.executable, "-c", "raise SystemExit(3)"], check=False) == 3
    with pytest.raises(subprocess.CalledProcessError):
        run_child([sys.executable, "-c", "raise SystemExit(3)"])
