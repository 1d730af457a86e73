"""The ``aiospawn`` command: run a script, a module, a function or any program as N ranks.

The command's reference (options, launch modes, environment, signals, exit
status) is the docs' command-line page (``docs/cli.md``) and ``aiospawn run
--help``; this package is their implementation. How each rank runs its target::

    aiospawn (launcher) ── anyio.run (asyncio) ── aiospawn.start_processes(rank_*, ...)
      │  signals: SIGINT SIGTERM SIGHUP SIGQUIT → graceful shutdown, exit 128+signal
      ├── rank 0 (own process group) ─ runpy: script/module as __main__, sys.argv set
      ├── rank 1 (own process group) ─ --fn: import module, call function(rank, *args)
      └── ...                          ─ --no-python: program as a child process, in the
                                         rank's process group; its exit status becomes the rank's

One command, four steps, one module each: ``_parse`` (the flag table, with
``_values``, each option's value checked, and ``_torchrun``, torchrun's command
line read beside ours) -> ``_plan`` (a checked command line, with ``_target``,
what each rank runs, found and checked) -> ``_run``
(supervision and signals, with ``_status``, the live status line) -> ``_report``
(the summary and the exit status) and ``_errorfile`` (torchrun's error file);
``_streams`` makes a closed output pipe end the launcher as it ends other tools.
With ``--nnodes`` above 1 the launcher is one node of a job: ``_nodes``
checks the rendezvous flags, ``_rendezvous`` joins torch's rendezvous and
keeps the round's records in its store, ``_rounds`` runs the local ranks
round after round and stops them when another node's record says so.
What each rank runs lives in ``aiospawn._rank.programs``, which a rank imports
instead of this package.

Import rule: this package may import ``aiospawn`` (its public API), anyio, the
standard library, ``aiospawn._core`` and ``aiospawn._rank``; of the backends,
``aiospawn._local._backend`` (the plan's check and ``LocalBackend``) and
``aiospawn.ray`` (``--ray``); and torch in ``_rendezvous`` alone, only on the
multi-node path. Nothing imports it but ``aiospawn.__main__`` and the
``aiospawn`` script.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``aiospawn`` command line; return the exit status.

    With ``--nnodes`` (one node of a job) it does not return once the job
    has run: it ends the process with the job's status (see
    :func:`end_at_once`).

    Args:
        argv: The arguments after the program name; ``None`` for ``sys.argv[1:]``.

    Raises:
        SystemExit: For ``--help`` and ``--version`` (status 0), and with no
            command at all, after the usage (status 2).
    """
    try:
        # Imported here, inside the try (about 0.14 s): a Ctrl-C while they
        # load ends the launcher as a later one before the ranks start does,
        # with 130 and no traceback.
        import anyio

        from ._parse import PROG, UsageError, parse
        from ._plan import Plan
        from ._report import say
        from ._run import supervise
        from ._streams import die_of_sigpipe_on_closed_output

        try:
            options = parse(argv)
            plan = Plan(options)
        except UsageError as exc:
            say(f"error: {exc} (see '{PROG} run --help')")
            return 2
        if plan.omp_note and plan.nprocs > 1:
            say(
                f"OMP_NUM_THREADS is unset: setting it to 1 in each of the {plan.nprocs}"
                " ranks so they do not oversubscribe the CPUs; set it to choose another value"
            )
        _log_to_stderr(f"{PROG}: ", verbose=plan.verbose)
        # Like other command-line tools, die of SIGPIPE when the reader of our
        # output is gone (a pipe to head); the ranks die with us.
        die_of_sigpipe_on_closed_output()

        if plan.nodes is not None:
            # One node of several: torch's rendezvous is imported on this path only.
            from ._rounds import supervise_nodes

            status = 1
            try:
                status = anyio.run(supervise_nodes, plan, backend="asyncio")
            except KeyboardInterrupt:  # before the signal handlers were in place
                status = 130
            except Exception:
                traceback.print_exc()
            end_at_once(status)
        return anyio.run(supervise, plan, backend="asyncio")
    except KeyboardInterrupt:  # Ctrl-C before the signal handlers were in place
        return 130


def end_at_once(status: int) -> NoReturn:
    """End the launcher of a node with ``status`` as a rank ends (``aiospawn._rank.ending``).

    Python's exit steps run (the atexit handlers, which stop warm templates,
    ``multiprocessing``'s finalizers, which remove a fork server's temp dir,
    the streams flushed), not the interpreter's finalization. Its threads are
    not waited for: none of them runs a user's code, so none has a user's
    work to finish. A call to torch's rendezvous store that the launcher
    stopped waiting for (:func:`._rounds.off_loop` leaves it in a daemon
    thread) may return during the finalization; its thread then exits inside
    torch's C++ code, which aborts the process (SIGABRT, "terminate called
    without an active exception") after the job's report, and the node's
    status is lost.

    Args:
        status: The launcher's exit status.

    Cancellation:
        A Ctrl-C during the exit steps is printed and the next step runs;
        the process still ends with ``status``.
    """
    from aiospawn._rank.ending import end

    end(status, join_threads=False)


class _EveryLinePrefixed(logging.Formatter):
    """The library's log lines as the launcher's own: each line begins with the program's name.

    A record can span lines (a restart's warning carries the rank's error),
    and a reader of the launcher's stderr tells its lines from the ranks' by
    the prefix.
    """

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self._prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        return "\n".join(self._prefix + line for line in super().format(record).split("\n"))


def _log_to_stderr(prefix: str, *, verbose: bool) -> None:
    """Show the library's log on stderr: warnings, and with ``-v`` its notes too."""
    logger = logging.getLogger("aiospawn")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_EveryLinePrefixed(prefix))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO if verbose else logging.WARNING)
        logger.propagate = False
