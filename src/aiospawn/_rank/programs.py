"""What a rank of ``aiospawn run`` runs: a script, a module, a function or a program.

Each function here is a rank's ``fn``, called as ``fn(rank, *args)`` in the
rank's process once its environment and output streams are in place. They
live apart from the launcher so that a rank imports this module alone; the
imports each needs are made inside it, for the same reason.
"""

from __future__ import annotations

import os
import sys

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = ["rank_function", "rank_module", "rank_program", "rank_script", "resolve_function"]

#: Signals a ``--no-python`` rank passes on to its program.
FORWARDED_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")


def rank_script(rank: int, path: str, args: list[str]) -> None:
    """Run the file ``path`` as ``__main__`` with ``sys.argv = [path, *args]``."""
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    _run_user_code(lambda: _run_main_script(path))


def _run_main_script(path: str) -> None:
    """Run the script ``path`` as ``__main__``, as ``python path`` does.

    ``__file__`` (and the file name in tracebacks) is absolute, and
    ``sys.argv[0]`` stays ``path`` as typed, which is also what torchrun's
    ranks see. ``runpy.run_path`` cannot give both: it puts the path it is
    given in both places. It still runs a directory or a zip file with a
    ``__main__.py``, given the path as typed, as ``python`` does for those.
    """
    import io
    import pkgutil
    import runpy
    import types

    absolute = os.path.abspath(path)
    if pkgutil.get_importer(absolute) is not None:
        runpy.run_path(path, run_name="__main__")
        return
    with io.open_code(absolute) as file:
        code = pkgutil.read_code(file)  # a compiled file, or None
    if code is None:
        with io.open_code(absolute) as file:
            code = compile(file.read(), absolute, "exec")
    main = types.ModuleType("__main__")
    vars(main).update(__file__=absolute, __cached__=None)
    # As runpy does: __main__ is the script's while it runs (a spawn pool's
    # workers find the script through it), the rank's own again after.
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(code, main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def rank_module(rank: int, name: str, args: list[str]) -> None:
    """Run the module ``name`` as ``__main__``, as ``python -m name *args`` does."""
    import runpy

    sys.argv = [name, *args]  # run_module puts the module's file in argv[0]
    sys.path[0] = os.getcwd()
    _run_user_code(lambda: runpy.run_module(name, run_name="__main__", alter_sys=True))


def rank_function(rank: int, target: str, args: list[str]) -> None:
    """Import ``module:function`` and call ``function(rank, *args)``."""
    sys.argv = [target, *args]
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    _run_user_code(lambda: resolve_function(target)(rank, *args))


def rank_program(rank: int, argv: list[str]) -> None:
    """Run ``argv`` as a child process and end as it ends (exit code or signal)."""
    import contextlib
    import signal
    import subprocess

    program: subprocess.Popen[bytes] | None = None
    pidfd: int | None = None
    pending: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if program is None:
            pending.append(signum)
        elif program.returncode is None:
            # Through a pidfd: once the program is reaped, its pid may be reused.
            # ESRCH: reaped by wait() a moment ago, returncode not yet set.
            with contextlib.suppress(ProcessLookupError):
                if pidfd is not None:
                    signal.pidfd_send_signal(pidfd, signum)
                else:
                    os.kill(program.pid, signum)

    forwarded = [getattr(signal, name) for name in FORWARDED_SIGNALS]
    for signum in forwarded:
        signal.signal(signum, forward)  # handlers reset to default in the program (exec)
    try:
        program = subprocess.Popen(argv, preexec_fn=_die_with_parent())
    except OSError as exc:
        print(f"aiospawn: rank {rank} cannot run {argv[0]!r}: {exc}", file=sys.stderr)
        sys.exit(126 if isinstance(exc, PermissionError) else 127)
    try:
        pidfd = os.pidfd_open(program.pid)
    except (AttributeError, OSError):  # no pidfd: not Linux, or Linux < 5.3
        pidfd = None
    for signum in pending:
        forward(signum, None)
    returncode = program.wait()  # PEP 475: retried after each forwarded signal
    if pidfd is not None:
        os.close(pidfd)
    if returncode >= 0:
        sys.exit(returncode)  # 0 is success, as for any rank
    # Killed by a signal: die of the same one, so the launcher reports it.
    signum = -returncode
    sys.stdout.flush()
    sys.stderr.flush()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # a signal whose default action is not to terminate


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the program get SIGKILL when the rank dies.

    The rank's supervisor guard kills the rank's process group when the
    launcher dies; this covers the rank itself dying first (say, SIGKILLed
    alone), which would otherwise leave the program running. prctl(2): the
    signal comes when the thread that forked the program exits, here the
    rank's main thread, which lives as long as the rank.
    """
    try:
        import ctypes
        import signal

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):  # not Linux
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the rank died before prctl took effect
            os._exit(1)

    return preexec


def _run_user_code(run: Callable[[], object]) -> None:
    """Run the user's code; print an uncaught exception's traceback as Python would."""
    import runpy
    import signal

    # As at any Python program's start (a fork rank inherits the launcher's default).
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        run()
    except SystemExit:
        raise
    except BaseException as exc:
        import traceback

        # The traceback starts in the user's code: this module's frames and
        # runpy's are not theirs. None left: the call itself failed (say, a
        # function taking other arguments), and the message says it all.
        tb = exc.__traceback__
        ours = {__file__, runpy.__file__, "<frozen runpy>"}
        while tb is not None and tb.tb_frame.f_code.co_filename in ours:
            tb = tb.tb_next
        traceback.print_exception(exc.with_traceback(tb))
        sys.stderr.flush()
        raise exc


def resolve_function(target: str) -> Callable[..., object]:
    """Import ``package.module:function`` (the function part may be dotted).

    Raises:
        ValueError: ``target`` is not ``module:function``, or the function is
            missing or not callable.
        ImportError: The module cannot be imported.
    """
    import importlib

    module_name, colon, qualname = target.partition(":")
    if not colon or not module_name or not qualname:
        raise ValueError(f"--fn wants package.module:function, got {target!r}")
    value: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no function {qualname!r}") from None
    if not callable(value):
        raise ValueError(f"{target!r} is not callable, got {value!r}")
    return value  # type: ignore[no-any-return]
