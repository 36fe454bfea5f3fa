"""A ring whose creator was killed -9 is removed by the next ring's creator (issue 42 item 8:
under Ray nothing else is left to remove an engine core's broadcast segment)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from treadle.ipc.shm_ring import ShmRingBuffer, remove_dead_creators_segments

# The child's ring is left to its creator alone, as an engine core's is while the front end (whose
# resource tracker the engine core shares) keeps running: a tracker of its own would remove it.
CHILD = """
import sys, time
from multiprocessing import resource_tracker
from treadle.ipc.shm_ring import ShmRingBuffer
ring = ShmRingBuffer(1, 4096, 4)
resource_tracker.unregister(ring.shared_memory._name, "shared_memory")
print(ring.shared_memory.name, flush=True)
time.sleep(600)
"""


def _ring_of_a_child() -> tuple[subprocess.Popen[str], str]:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    return child, child.stdout.readline().strip()


def test_a_killed_creators_ring_is_removed_by_the_next_creator_and_a_live_ones_is_kept() -> None:
    dead, dead_name = _ring_of_a_child()
    live, live_name = _ring_of_a_child()
    try:
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(timeout=30)
        assert os.path.exists(f"/dev/shm/{dead_name}")  # what kill -9 leaves
        ring = ShmRingBuffer(1, 4096, 4)  # a new creator, e.g. the restarted engine core
        try:
            assert not os.path.exists(f"/dev/shm/{dead_name}")
            assert os.path.exists(f"/dev/shm/{live_name}")  # its creator runs: kept
            assert os.path.exists(f"/dev/shm/{ring.shared_memory.name}")
            assert remove_dead_creators_segments() == []
        finally:
            ring.close()
    finally:
        live.kill()
        live.wait(timeout=30)
        dead.kill()
    # The live child was killed too: its ring goes with the next sweep, and only then.
    assert os.path.exists(f"/dev/shm/{live_name}")
    assert remove_dead_creators_segments() == [live_name]
