"""How ``fn`` and ``args`` reach a rank that does not inherit them: pickled, by reference or value.

A ``spawn``, ``forkserver`` or warm-start rank receives ``fn`` and ``args``
pickled. An object it could import goes by reference (plain pickle, as
multiprocessing does); one it could not (a lambda, a local function or class,
anything defined in an interactive ``__main__``: a notebook cell,
``python -c``, a script read from standard input, the REPL) goes by value,
with cloudpickle. :func:`needs_value` is the one rule that tells them apart;
:func:`goes_by_value` applies it to ``fn`` when a group is checked, and
:func:`dumps_payload` to ``fn`` and ``args`` together as each rank starts,
inside a :class:`SendPayload`. A ``fork`` rank inherits both as they are.

Light on purpose: the group's check imports it before the supervisor's modules.
"""

from __future__ import annotations

import collections
import functools
import io
import os
import pickle
import sys
import types
from collections.abc import Callable, Mapping
from multiprocessing.reduction import ForkingPickler
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from aiospawn._core._spec import LaunchSpec


def interactive_main() -> bool:
    """True if ``__main__`` cannot be imported again by a ``spawn`` or ``forkserver`` rank.

    That is a notebook or IPython session, ``python -c``, the REPL (no
    ``__file__``), or a script read from standard input (``__file__`` is
    ``"<stdin>"``, not a file). A main module run with ``-m`` is imported by name.
    """
    main = sys.modules.get("__main__")
    if main is None:
        return True
    if getattr(main, "__spec__", None) is not None:
        return False
    path = getattr(main, "__file__", None)
    return path is None or not os.path.isfile(path)


def needs_value(obj: object, interactive: bool | None = None) -> bool:
    """True if a rank could not import ``obj`` (a function or class) by its name.

    Lambdas, functions and classes defined inside a function, and those of an
    interactive ``__main__``; ``interactive`` is :func:`interactive_main`,
    computed here if not given.
    """
    if not isinstance(obj, type | types.FunctionType):
        return False
    qualname = getattr(obj, "__qualname__", "")
    if "<lambda>" in qualname or "<locals>" in qualname:
        return True
    if getattr(obj, "__module__", None) != "__main__":
        return False
    return interactive_main() if interactive is None else interactive


def goes_by_value(fn: Callable[..., Any]) -> bool:
    """True if ``fn`` must reach a rank by value: plain pickle would not do."""
    try:
        _FindValues(io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL).dump(fn)
    except Exception:  # _NeedsValue, or plain pickle failed: cloudpickle may still send it
        return True
    return False


def check_by_value(fn: Callable[..., Any], rank: str, instead: str) -> None:
    """Raise TypeError if ``fn`` cannot be pickled by value either.

    Args:
        fn: The group's function, known to need cloudpickle (:func:`goes_by_value`).
        rank: The kind of rank that would receive it, for the message ("a 'spawn' rank").
        instead: What to do instead, for the message ("use start_method='fork'").
    """
    import cloudpickle  # type: ignore[import-untyped]

    try:
        cloudpickle.dumps(fn)
    except Exception as exc:
        raise TypeError(
            f"fn {fn!r} cannot be pickled, even by value, so {rank} cannot"
            f" receive it ({exc}); make fn and what it refers to picklable (define it at the"
            f" top level of a module), or {instead}"
        ) from exc


class _NeedsValue(Exception):
    """Raised on meeting an object that must go by value."""


class _FindValues(pickle.Pickler):
    """Plain pickle that stops at the first object :func:`needs_value` picks out.

    ``reducer_override`` sees every object but the built-in containers and
    scalars, classes and functions included, before pickle looks them up by name.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._interactive = interactive_main()  # once: it looks at the file system

    def reducer_override(self, obj: object) -> Any:
        if needs_value(obj, self._interactive):
            raise _NeedsValue
        return NotImplemented


class _ByReference(_FindValues, ForkingPickler):
    """:class:`_FindValues` with multiprocessing's reducers, as ``Process.start()`` pickles.

    They pass the pipes, connections and sockets among the arguments on to the
    rank as descriptors.
    """


@functools.cache
def _by_value() -> type[pickle.Pickler]:
    import cloudpickle  # only for what plain pickle cannot send

    class ByValue(cloudpickle.Pickler):  # type: ignore[misc]
        # Set on the class: the C pickler reads it when it is made. cloudpickle's
        # reducers first, then multiprocessing's (see _ByReference).
        dispatch_table: ClassVar[Mapping[type, Any]] = collections.ChainMap(
            cloudpickle.Pickler.dispatch_table, ForkingPickler(io.BytesIO()).dispatch_table
        )

    return ByValue


def dumps_payload(
    fn: Callable[..., Any], args: tuple[Any, ...], *, by_value: bool
) -> tuple[bool, bytes]:
    """Pickle ``(fn, args)`` for a rank: by reference, or with cloudpickle if anything needs it.

    ``by_value`` skips the plain attempt (``fn`` is known to need it). Call
    it while ``Process.start()`` pickles the rank, whose reducers then pass
    descriptors. The rank unpickles either kind with plain ``pickle.loads``:
    a cloudpickle payload imports cloudpickle there, and only then.

    Returns:
        ``(by_value, data)``: whether cloudpickle was needed, and the pickle.

    Raises:
        Exception: What pickling ``fn`` or ``args`` raised, unchanged.
    """
    if not by_value:
        buffer = io.BytesIO()
        try:
            _ByReference(buffer, pickle.HIGHEST_PROTOCOL).dump((fn, args))
        except _NeedsValue:
            pass
        else:
            return False, buffer.getvalue()
    buffer = io.BytesIO()
    _by_value()(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((fn, args))
    return True, buffer.getvalue()


class SendPayload:
    """Pickles into the rank's :class:`~aiospawn._rank.bootstrap.Payload`.

    Sent in place of ``fn``, with no ``args``, when ``fn`` or ``__main__``
    needs it: pickled once per rank, as multiprocessing pickled ``fn`` and
    ``args`` before, and on the thread that starts the rank; an error is
    raised from ``Process.start()`` unchanged.
    """

    def __init__(self, spec: LaunchSpec, *, by_value: bool) -> None:
        self._spec = spec
        self._by_value = by_value

    def __reduce__(self) -> tuple[Any, ...]:
        from aiospawn._rank.bootstrap import unpickle_in_rank, unpickle_now

        spec = self._spec
        by_value, data = dumps_payload(spec.fn, spec.args, by_value=self._by_value)
        return (unpickle_in_rank if by_value else unpickle_now), (data,)
