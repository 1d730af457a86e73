"""How a process of ours ends: Python's exit steps, short of the interpreter's finalization.

A rank ends so once ``fn`` has ended (``bootstrap``), and so does the
launcher once a job across several nodes has ended (``aiospawn._cli``). In
both, the interpreter's finalization is what must not run: threads still in
an extension library's C++ code (a rendezvous store call left waiting), and
its static destructors, may abort the process there (SIGABRT) after its work
is done, and its exit status is lost. What a program expects at its end does
run, in Python's order: the wait for non-daemon threads, the atexit handlers
(a warm template's stop, the logging module's flush), ``multiprocessing``'s
exit function (its finalizers: a fork server's temp dir removed, a Queue's
feeder thread flushed, its children joined), and the streams flushed.

Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import contextlib
import os
import sys

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn


def end(status: int, *, join_threads: bool = True) -> NoReturn:
    """Run :func:`exit_steps`, then end the process with ``status``, whatever they raised.

    Args:
        status: The exit status.
        join_threads: Wait for the non-daemon threads first, as Python does;
            the launcher, which runs no code of a user's, does not.

    Cancellation:
        A ``KeyboardInterrupt`` during the steps is printed with the step's
        error and the next step runs; the process still ends with ``status``.
    """
    try:
        exit_steps(join_threads=join_threads)
    finally:
        os._exit(status)


def exit_steps(*, join_threads: bool = True) -> None:
    """What a Python program runs at its end, short of the interpreter's finalization.

    In the order Python runs them: the wait for non-daemon threads (with
    ``join_threads``), then the atexit handlers, then ``multiprocessing``'s
    exit function, then the streams are flushed: ``sys.stdout`` and
    ``sys.stderr`` (and the originals, ``sys.__stdout__`` and
    ``sys.__stderr__``), and the C library's, when ``ctypes`` is loaded. A
    step that raises is printed, as Python prints it, and the next one runs.
    """
    import atexit
    import threading
    from multiprocessing import util

    steps = (
        *((threading._shutdown,) if join_threads else ()),  # type: ignore[attr-defined]
        atexit._run_exitfuncs,  # prints what a handler raises, and goes on
        util._exit_function,  # type: ignore[attr-defined]
    )
    for step in steps:
        try:
            step()
        except BaseException:
            with contextlib.suppress(BaseException):
                import traceback

                traceback.print_exc()
    # The original streams too: code that replaced sys.stdout (a fork rank of
    # a program that captures its output) leaves them in use, unflushed.
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(BaseException):
            if stream is not None:
                stream.flush()
    ctypes = sys.modules.get("ctypes")
    if ctypes is not None:
        # What a C extension printed with stdio and left in its buffer (a
        # pipe or a file is fully buffered): exit(3) would flush it, _exit(2)
        # does not. Only when ctypes is loaded already: importing it would
        # cost every rank's end a few milliseconds.
        with contextlib.suppress(BaseException):
            ctypes.CDLL(None).fflush(None)
