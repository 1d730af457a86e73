"""What a ``spawn`` or ``forkserver`` rank unpickles from its supervisor before ``fn``.

Two things travel pickled with the process and act as they are unpickled:

- the process's name (:func:`early_environment`), which sets the rank's
  environment before the main module and ``fn``'s module are imported;
- ``fn`` and ``args`` as one :class:`Payload`, unpickled with the process
  object (by reference: :func:`unpickle_now`) or only once the rank has set
  itself up (by value: :func:`unpickle_in_rank`), where a failure is reported
  as one of ``fn``.

The supervisor's side is ``aiospawn._local._launcher``, which pickles both.
Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import operator
import pickle

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


class _EarlyEnvironment(str):
    """A process name that sets the rank's environment as it is unpickled.

    Under ``spawn`` and ``forkserver`` the new process unpickles the name
    (with the rest of its preparation data) before it imports the main
    module and ``fn``'s module, so the variables are in place for them. That
    is also before ``sys.path`` is set up, so the unpickling may only call
    the standard library: it unpickles as calls of built-ins on ``os`` and
    ``sys`` (see :class:`_Call`), never as code to compile, which every rank
    would pay for.

    With ``main``, it also gives the rank's ``__main__`` that ``__file__``:
    multiprocessing then takes the main module as already loaded instead of
    running it again from a path that is no file (a script read from
    standard input has ``__file__ == "<stdin>"``, and its ranks died in
    ``FileNotFoundError`` before our code ran). Such a rank's ``fn`` comes by
    value, so it needs nothing of that ``__main__``.
    """

    env: dict[str, str]
    main: str | None

    def __reduce__(self) -> tuple[Any, ...]:
        environ = _Call(getattr, _Call(__import__, "os"), "environ")
        steps: list[Any] = [_Call(operator.methodcaller("update", self.env), environ)]
        if self.main is not None:
            modules = _Call(getattr, _Call(__import__, "sys"), "modules")
            main_module = _Call(operator.getitem, modules, "__main__")
            steps.append(_Call(setattr, main_module, "__file__", self.main))
        # The steps are unpickled (so called) in order, then the name is the value.
        return operator.getitem, ((*steps, str(self)), -1)


class _Call:
    """Unpickles as ``fn(*args)``, called by the unpickler; an argument may be a ``_Call`` too.

    Only ``fn`` and ``args`` travel: unpickling needs nothing of ours.
    """

    __slots__ = ("_call",)

    def __init__(self, fn: Callable[..., Any], *args: Any) -> None:
        self._call = (fn, args)

    def __reduce__(self) -> tuple[Any, ...]:
        return self._call


def early_environment(name: str, env: dict[str, str] | None, main: str | None = None) -> str:
    """``name``, which also carries ``env`` (and ``main``) into a rank before its imports.

    See :class:`_EarlyEnvironment`. Only for ``spawn`` and ``forkserver``
    ranks: a ``fork`` rank keeps its name unpickled, and any process that
    unpickled it later (a log record's ``processName``) would take the
    variables too.
    """
    if not env and main is None:
        return name
    carrier = _EarlyEnvironment(name)
    carrier.env = env or {}
    carrier.main = main
    return carrier


class Payload:
    """``fn`` and ``args`` of a ``spawn`` or ``forkserver`` rank, as the supervisor pickled them.

    Made by :func:`unpickle_now` or :func:`unpickle_in_rank`, which the
    supervisor's pickle names (see ``_local._launcher``).
    """

    __slots__ = ("_data", "_work")

    def __init__(
        self, data: bytes | None, work: tuple[Callable[..., Any], tuple[Any, ...]] | None
    ) -> None:
        self._data = data
        self._work = work

    def load(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        """Return ``(fn, args)``, unpickling them if that has not happened yet."""
        if self._work is None:
            assert self._data is not None
            fn, args = pickle.loads(self._data)
            self._work, self._data = (fn, args), None
        return self._work


def unpickle_now(data: bytes) -> Payload:
    """By reference: unpickled with the process object, as multiprocessing does.

    That is while the supervisor's ``Process.start()`` still waits, once the
    environment and ``__main__`` are in place, and it imports ``fn``'s module.
    """
    fn, args = pickle.loads(data)
    return Payload(None, (fn, args))


def unpickle_in_rank(data: bytes) -> Payload:
    """By value (cloudpickle): unpickled in the rank once it is set up, before ``fn`` runs.

    By then the guard runs and the streams are redirected, and a failure is
    reported as one of ``fn`` (a module the rank lacks, say; see
    :func:`~aiospawn._rank.outcome.run_fn`). Plain
    ``pickle.loads`` reads it, and imports cloudpickle, in those ranks only.
    """
    return Payload(data, None)
