"""Whether a block may hold Ctrl-C for itself.

Two places take SIGINT over for a while: host training in worker threads turns it into a
stop the workers finish their step for (``esper.tolaria.parallel``), and a checkpoint
write delays it until the file is whole (``esper.callbacks.checkpoint``). Both may do so
only in the main thread, the one Python runs signal handlers in, and only where Python's
own handler is installed: a program that set its own SIGINT handler keeps it.
"""

from __future__ import annotations

import signal
import threading


def python_handles_sigint() -> bool:
    """True in the main thread while SIGINT has Python's default handler."""
    return (
        threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    )
