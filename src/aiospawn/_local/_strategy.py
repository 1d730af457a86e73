"""How a group's local ranks are made and started: one strategy per start method.

A group's strategy is chosen once, when the group is checked (:func:`choose`),
and holds every way the start methods differ; the launcher makes each rank's
pipes, output and setup the same way whatever the method, and asks the
strategy for the rest::

    strategy    the process is      fn, args    its parent   its exit read   its start
    Spawn       a fresh interpreter pickled     us           from a pidfd    on a worker thread
    Forkserver  forked by the       pickled     the fork     from the        on a worker thread
                fork server                     server       sentinel
    Fork        a fork of us        inherited   us           from a pidfd    on the loop's thread,
                                                                             one at a time
    Warm        forked by a         pickled     the          from the        a template leased,
                template                        template     sentinel        then on a worker
                (``preload=``)                                               thread

"Pickled" is by reference, or by value when ``fn`` needs it (``_pickling``);
"on a worker thread" is on the starter threads (``_starters``), side by
side with the process's other starts.

Why a start runs on a worker thread, or on the loop's thread, is told in
``_starters``.

A warm group first leases a ready template (``_template``): waiting for its
import happens on the event loop, cancellable, with no thread blocked; the
forks then run on threads as other starts do (the template answers at once).

Light on purpose: the group's check imports it before the supervisor's
modules, so that a first ``forkserver`` group's server starts up meanwhile
(:meth:`Strategy.prepare`); what making and starting ranks needs (the rank
bootstrap and its wire format, the templates, the seam's start error) is
imported when it is used.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.process
import os
import sys
import threading
import weakref
from collections import ChainMap
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import anyio
import anyio.to_thread

from aiospawn._core._loops import running_asyncio_loop

from ._pickling import SendPayload, check_by_value, goes_by_value, interactive_main
from ._starters import start_ranks

if TYPE_CHECKING:
    from aiospawn._core._spec import LaunchSpec
    from aiospawn._rank.bootstrap import RankSetup
    from aiospawn._rank.wire import ChildEnd

    from ._rank import LocalRank

START_METHODS = ("spawn", "fork", "forkserver")


def resolve_start_method(start_method: object) -> str:
    """The start method to use: ``start_method``, or the platform's default for None.

    Raises:
        ValueError: ``start_method`` is not one of :data:`START_METHODS` or
            None, or this platform does not have it.
    """
    if start_method is None:
        return multiprocessing.get_context().get_start_method()
    if start_method not in START_METHODS:
        raise ValueError(
            f"start_method must be one of {', '.join(map(repr, START_METHODS))} or None,"
            f" got {start_method!r}"
        )
    available = multiprocessing.get_all_start_methods()
    if start_method not in available:
        raise ValueError(
            f"start_method={start_method!r} is not available on this platform; use one of"
            f" {', '.join(map(repr, available))}"
        )
    return str(start_method)


def choose(spec: LaunchSpec) -> Strategy:
    """The strategy of the group ``spec``.

    Raises:
        ValueError: The start method is unknown or not available here (see
            :func:`resolve_start_method`), or is ``"fork"`` with ``preload``.
    """
    method = resolve_start_method(spec.start_method)
    if not spec.preload:
        return _BY_METHOD[method](spec)
    if spec.start_method == "fork":
        raise ValueError(
            "preload= forks ranks from a spawned template; start_method='fork' copies"
            " the supervisor instead: use start_method='spawn' (or 'forkserver') with preload"
        )
    # With None too, whatever the platform's default: the template is spawned.
    return Warm(spec)


class Strategy:
    """How the ranks of one group are made and started; one object per group.

    The base is what most strategies do; each start method's class says how
    it differs (see the table above).
    """

    #: What the rank's bootstrap is told of how its process was made
    #: (``RankSetup.start_method``).
    name: ClassVar[str]
    #: The rank is a child of the supervisor, not of a fork server or a
    #: template, so its guard may also watch its parent.
    supervisor_is_parent: ClassVar[bool] = True
    #: The rank's parent reaps it and sends its exit status through the
    #: sentinel: a pidfd would wake us before the status is there.
    exit_via_sentinel: ClassVar[bool] = False

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec

    def check(self) -> None:
        """Refuse a ``fn`` that cannot reach this strategy's ranks; nothing to refuse here."""

    async def prepare(self) -> None:
        """Start, before the supervisor's modules load, what the first rank needs; nothing here."""

    def inherited(self) -> Mapping[int, tuple[int, int]] | None:
        """The supervisor's descriptors a rank finds in its table and drops; None if it has none."""
        return None

    def process(self, index: int, writer: ChildEnd, setup: RankSetup, name: str) -> Any:
        """The process, not yet started, that runs rank ``index``.

        Args:
            index: The rank.
            writer: The rank's end of its result pipe.
            setup: The rank's surroundings.
            name: The process's name.
        """
        raise NotImplementedError

    async def start(self, ranks: Sequence[LocalRank]) -> None:
        """Start ``ranks`` on starter threads, side by side (see :func:`start_ranks`)."""
        await start_ranks(ranks, on_threads=True)


class _Pickled(Strategy):
    """A strategy whose ranks receive ``fn`` and ``args`` pickled (``_pickling``)."""

    #: Who receives ``fn``, and what to do if it cannot, as refusals say it.
    receiver: ClassVar[str]
    instead: ClassVar[str] = "use start_method='fork'"

    def __init__(self, spec: LaunchSpec) -> None:
        super().__init__(spec)
        self.by_value = goes_by_value(spec.fn)

    def check(self) -> None:
        """Raise TypeError if ``fn`` cannot be pickled, even by value."""
        if self.by_value:
            check_by_value(self.spec.fn, self.receiver, self.instead)

    def work(self) -> tuple[Any, tuple[Any, ...]]:
        """What the rank is handed for ``fn`` and ``args``.

        As multiprocessing sends them (pickled inline with the process object,
        at no extra cost), or one payload that goes by value when ``fn``, or
        anything defined in an interactive ``__main__``, needs it (``run_rank``
        unpacks it).
        """
        spec = self.spec
        if self.by_value or interactive_main():
            return SendPayload(spec, by_value=self.by_value), ()
        return spec.fn, spec.args


class Spawn(_Pickled):
    """Each rank a fresh interpreter: nothing of this process reaches it but what is sent."""

    name = "spawn"
    receiver = "a 'spawn' rank"

    def process(self, index: int, writer: ChildEnd, setup: RankSetup, name: str) -> Any:
        """A ``multiprocessing`` process whose name carries the rank's environment."""
        from aiospawn._rank.bootstrap import early_environment, run_rank

        # typeshed gives get_context(str) the BaseContext type, which lacks Process.
        context: Any = multiprocessing.get_context(self.name)
        fn, args = self.work()
        return context.Process(
            target=run_rank,
            args=(fn, index, args, writer, setup),
            daemon=self.spec.daemon,
            # Set before the rank imports the main script or fn's module.
            name=early_environment(name, setup.env, _unloadable_main_path()),
        )


class Forkserver(Spawn):
    """Each rank forked by ``multiprocessing``'s fork server, which reaps it."""

    name = "forkserver"
    receiver = "a 'forkserver' rank"
    supervisor_is_parent = False
    exit_via_sentinel = True

    async def prepare(self) -> None:
        """Start the fork server now, once per process, so that it starts up meanwhile."""
        module = sys.modules.get(f"{__package__}._forkserver")
        if module is None or not module.started_here():
            await anyio.to_thread.run_sync(_start_fork_server)


class Fork(Strategy):
    """Each rank a fork of this process: it inherits ``fn`` and ``args`` as they are."""

    name = "fork"

    def inherited(self) -> Mapping[int, tuple[int, int]]:
        """The live table of the supervisor's descriptors (see :func:`_fork_table`)."""
        return _fork_table()

    def process(self, index: int, writer: ChildEnd, setup: RankSetup, name: str) -> Any:
        """A ``multiprocessing`` fork process; nothing is pickled."""
        from aiospawn._rank.bootstrap import run_rank

        context: Any = multiprocessing.get_context(self.name)
        spec = self.spec
        return context.Process(
            target=run_rank,
            args=(spec.fn, index, spec.args, writer, setup),
            daemon=spec.daemon,
            name=name,
        )

    async def start(self, ranks: Sequence[LocalRank]) -> None:
        """Fork ``ranks`` on this thread, one at a time (see :func:`start_ranks`)."""
        await start_ranks(ranks, on_threads=False)


class Warm(_Pickled):
    """Each rank forked by a template that imported ``preload`` once (``_template``)."""

    name = "warm"
    receiver = "a warm-start rank (preload=)"
    instead = "drop preload= and use start_method='fork'"
    supervisor_is_parent = False
    exit_via_sentinel = True

    def process(self, index: int, writer: ChildEnd, setup: RankSetup, name: str) -> Any:
        """A :class:`~._warm.WarmProcess`; its template is leased by :meth:`start`."""
        # Imported here: a group without preload= never needs it.
        from ._warm import WarmProcess

        fn, args = self.work()
        spec = self.spec
        return WarmProcess(
            spec.preload, fn, index, args, writer, setup, name=name, daemon=spec.daemon
        )

    async def start(self, ranks: Sequence[LocalRank]) -> None:
        """Lease the template of the preload list, then fork ``ranks`` from it side by side.

        Raises:
            RuntimeError: The template could not import the preload (a
                ``TemplateError``, with a note naming the lowest rank).
        """
        from aiospawn._core._backend import raise_start_error

        from ._templates import acquire, release
        from ._warm import WarmProcess

        try:
            template = await acquire(self.spec.preload)
        except BaseException as exc:
            for rank in ranks:
                rank.discard()
            if isinstance(exc, Exception) and ranks:
                raise_start_error({min(rank.rank for rank in ranks): exc}, len(ranks))
            raise
        try:
            for rank in ranks:
                assert isinstance(rank.process, WarmProcess)
                rank.process.template = template
            await start_ranks(ranks, on_threads=True)
        finally:
            release(template)  # each rank forked holds it on its own


def _start_fork_server() -> None:
    """Import ``_forkserver`` and start the server: on a worker thread, all of it.

    The import is part of the work: ``multiprocessing.forkserver`` pulls in
    ``multiprocessing.connection`` and ``tempfile`` (with ``shutil``,
    ``random`` and the compression modules), 11-12 ms of CPU here that would
    otherwise stall the event loop during a first call.
    """
    from . import _forkserver

    if not _forkserver.started_here():
        # It forks, execs and waits for the exec.
        _forkserver.start_early()


_BY_METHOD: dict[str, type[Strategy]] = {"spawn": Spawn, "forkserver": Forkserver, "fork": Fork}


def _unloadable_main_path() -> str | None:
    """The path a ``spawn`` rank would run ``__main__`` from, if that is not a file.

    The same path as multiprocessing's preparation data gives the rank
    (``spawn.get_preparation_data``): ``__file__``, made absolute from the
    directory the program started in.
    """
    main = sys.modules.get("__main__")
    path: str | None = getattr(main, "__file__", None)
    if path is None or not interactive_main():
        return None
    original_dir = multiprocessing.process.ORIGINAL_DIR  # type: ignore[attr-defined]
    if not os.path.isabs(path) and original_dir is not None:
        path = os.path.join(original_dir, path)
    return os.path.normpath(path)


#: The wakeup sockets of every event loop that has made a fork rank (see _fork_table).
_wakeup_sockets: weakref.WeakSet[Any] = weakref.WeakSet()
#: Loops in other threads make fork ranks too.
_wakeup_lock = threading.Lock()


def _fork_table() -> Mapping[int, tuple[int, int]]:
    """The supervisor descriptors a fork rank drops: the live table, and the loops' wakeup sockets.

    The table is live: the fork copies it as it is at that moment, with the
    descriptors of the ranks started before this one.

    A fork rank used to find the event loop's wakeup fd by asking
    ``signal.set_wakeup_fd``; since Python 3.12 asyncio resets it to -1 in
    every forked child (``asyncio.events.on_fork``) and leaves the socket
    open, whichever loop set it. So the supervisor names the wakeup sockets
    itself, from the loops' own attributes (read with ``getattr``: the
    architecture page lists them), and the rank drops them by file identity
    like any other descriptor of ours. Those of the running loop (two loops
    under trio's guest mode), and of every other loop that made a fork rank
    while it is open (a loop in another thread): the socket objects are held
    weakly and read at each fork, so a loop that closed its sockets (their
    ``fileno()`` is -1 then) or is gone leaves no stale number behind.
    """
    from . import _pipes

    with _wakeup_lock:
        _wakeup_sockets.update(_loop_wakeup_sockets())
        sockets = {}
        for sock in list(_wakeup_sockets):
            try:
                info = os.fstat(sock.fileno())
            except OSError:  # closed by its loop: fileno() is -1
                continue
            sockets[sock.fileno()] = (info.st_dev, info.st_ino)
    return ChainMap(_pipes.held(), sockets)


def _loop_wakeup_sockets() -> list[Any]:
    """The wakeup sockets of this thread's running loops: trio's, asyncio's, or both."""
    found = []
    trio = sys.modules.get("trio")
    runner = getattr(
        getattr(getattr(trio, "_core", None), "_run", None), "GLOBAL_RUN_CONTEXT", None
    )
    wakeup = getattr(getattr(getattr(runner, "runner", None), "entry_queue", None), "wakeup", None)
    if wakeup is not None:  # trio's WakeupSocketpair
        found += [wakeup.wakeup_sock, wakeup.write_sock]
    loop = running_asyncio_loop()
    # The selector loop's self-pipe, whose write end is its signal wakeup fd;
    # a trio run in guest mode has its asyncio host's too.
    found += [getattr(loop, "_ssock", None), getattr(loop, "_csock", None)]
    return [sock for sock in found if sock is not None and sock.fileno() >= 0]
