"""esper.sigint: a block may hold Ctrl-C only in the main thread, over Python's handler."""

from __future__ import annotations

import signal
import threading

from esper.sigint import python_handles_sigint


def test_only_the_main_thread_with_pythons_own_handler_may_hold_ctrl_c() -> None:
    assert python_handles_sigint()
    seen: list[bool] = []
    worker = threading.Thread(target=lambda: seen.append(python_handles_sigint()))
    worker.start()
    worker.join()
    assert seen == [False]  # signal handlers run in the main thread only
    previous = signal.signal(signal.SIGINT, lambda signum, frame: None)
    try:
        assert not python_handles_sigint()  # a program's own handler is left alone
    finally:
        signal.signal(signal.SIGINT, previous)
