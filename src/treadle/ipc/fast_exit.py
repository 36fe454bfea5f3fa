"""An exit without the interpreter's teardown, for a process whose work is over.

Python's own exit joins the non-daemon threads, runs the atexit hooks, then tears down every
module and object. In a process that imported torch the teardown alone takes 0.5-1 s on a
quiet machine and several seconds on a loaded one, and nothing of treadle's needs it: pyzmq
skips its contexts' destroy at exit anyway, shared memory is unlinked by name (explicitly or by
an atexit hook), and the kernel closes the fds and unmaps the memory. A headless host whose
front end is gone has to be gone within seconds (ARCHITECTURE §8).

Light on purpose (no torch): `treadle --help` imports it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Join the other non-daemon threads, run the atexit hooks, flush the standard streams
    and leave with `code`."""
    me = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not me and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
