"""A child's pipes are closed once: a second `close_pipes` (an `LLM` collected after a new one
started shut its stale workers down again) must not close the fd number that now serves
another child's death pipe, which would stop that child (issue 42: two -tp engines one after
the other in one process failed mid-step)."""

from __future__ import annotations

import multiprocessing
import time

import ipc_children

from treadle.ipc.process import start_process
from treadle.ipc.process_watch import wait_for_ready

FORK = multiprocessing.get_context("fork")


def test_a_second_close_of_a_stale_child_leaves_the_new_childs_death_pipe_open() -> None:
    old = start_process(ipc_children.sleeper, "Old", ctx=FORK)
    wait_for_ready([old], timeout=60)
    old.process.kill()
    old.process.join(10)
    old.close_pipes()
    new = start_process(ipc_children.sleeper, "New", ctx=FORK)
    try:
        wait_for_ready([new], timeout=60)
        assert new.death_writer == old.death_writer  # the fd number is reused, as it was
        old.close_pipes()  # the stale second close
        time.sleep(3.0)  # the child exits within its grace (2 s) once its death pipe closes
        assert new.process.is_alive()
    finally:
        new.process.kill()
        new.process.join(10)
        new.close_pipes()
