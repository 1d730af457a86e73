"""aiospawn.sync's failures as instances of torch's exception classes too, once torch is loaded.

Code written for ``torch.multiprocessing`` catches torch's classes by import
(accelerate's ``notebook_launcher``: ``from torch.multiprocessing.spawn import
ProcessRaisedException``, then ``except ProcessRaisedException``). A failure
that :mod:`aiospawn.sync` raises must be caught there, and still by ``except
aiospawn.ProcessRaisedException``. So, when torch's spawn module is loaded,
:func:`for_torch` turns the failure into an instance of a class derived from
both: aiospawn's class first, then torch's counterpart::

    aiospawn.ProcessRaisedException   torch.multiprocessing.spawn.ProcessRaisedException
                  └───────────────┬───────────────┘
        ProcessRaisedException (made here on first use, one per pair)

Why a class derived from both, and not the others one could think of:

- ``except`` matches by the class's real bases (``PyType_IsSubtype``): it
  ignores ``__subclasscheck__``, so neither registering with an ABC nor a
  metaclass makes torch's ``except`` catch aiospawn's class.
- aiospawn's classes cannot derive from torch's: ``import aiospawn`` would
  import torch (seconds, hundreds of MB), and aiospawn works without torch.
- Raising torch's own classes would break ``except aiospawn.ProcessException``
  and drop aiospawn's fields (``restarts``).

torch is never imported here: a class derived from torch's is made only when
``torch.multiprocessing.spawn`` is in ``sys.modules`` already (``import torch``
loads it). An ``except`` clause that names torch's class has loaded torch
before the failure reaches it; a program that never loaded torch gets
aiospawn's own classes, as without torch installed.

Both parents' fields hold the same values (torch stores ``error_index``,
``error_pid`` and ``exit_code`` in slots, which the combined class inherits;
aiospawn's ``__init__`` fills them), and the combined class keeps aiospawn's
name, module and message, so tracebacks and ``repr`` read as before. It
pickles through :func:`rebuild`, which makes the combined class again where
torch is loaded, and aiospawn's own class elsewhere.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from ._core._errors import ProcessException, ProcessExitedException, ProcessRaisedException

__all__ = ["for_torch", "rebuild"]

# aiospawn's classes and the names of torch's counterparts, most derived first.
_COUNTERPARTS = (
    (ProcessRaisedException, "ProcessRaisedException"),
    (ProcessExitedException, "ProcessExitedException"),
    (ProcessException, "ProcessException"),
)

_made: dict[tuple[type[ProcessException], type[Exception]], type[ProcessException]] = {}
_making = threading.Lock()  # one combined class per pair, whichever thread fails first


class _TorchInitSkipped(Exception):
    """Sits between aiospawn's classes and torch's in a combined class's MRO.

    aiospawn's ``ProcessException.__init__`` ends with ``super().__init__(msg)``,
    which in a combined class would reach torch's ``__init__``, whose signature
    is ``(msg, error_index, error_pid)``. This ends the chain as ``Exception``
    would: aiospawn's ``__init__`` has set every field torch's sets.
    """

    def __init__(self, msg: str) -> None:
        Exception.__init__(self, msg)  # not super(): the next class is torch's


def for_torch(error: ProcessException) -> ProcessException:
    """Return ``error`` as an instance of torch's counterpart class too, if torch is loaded.

    Args:
        error: A failure that :mod:`aiospawn.sync` is about to raise.

    Returns:
        ``error`` itself when torch's spawn module is not loaded, when it is
        an instance of torch's class already, or when no class can derive
        from both (a future torch's classes); otherwise an equal exception of
        the combined class, with the same fields, ``__cause__``,
        ``__context__``, notes and traceback.
    """
    try:
        combined = _combined(type(error))
        if combined is None or isinstance(error, combined):
            return error
        _, args, state = error.__reduce__()
        twin = combined(*args)
        twin.__setstate__(state)
    except Exception:  # whatever torch's classes became, the failure is reported
        # A torch whose classes cannot be combined with ours (a metaclass, an
        # __init_subclass__ that refuses): torch's except clauses then miss
        # the failure, but the caller still gets it, as aiospawn's own class.
        return error
    twin.__cause__ = error.__cause__
    twin.__context__ = error.__context__
    twin.__suppress_context__ = error.__suppress_context__
    return twin.with_traceback(error.__traceback__)


def rebuild(cls: type[ProcessException], args: tuple[Any, ...]) -> ProcessException:
    """Unpickle a combined class's exception: combined again if torch is loaded here.

    Args:
        cls: aiospawn's class of the pickled exception.
        args: Its constructor's arguments.

    Returns:
        An exception of the combined class if torch's spawn module is loaded in
        this process, else of ``cls``; pickle then restores its ``__dict__``.
    """
    try:
        combined = _combined(cls)
        if combined is not None:
            return combined(*args)
    except Exception:  # as in for_torch: then aiospawn's own class
        pass
    return cls(*args)


def _combined(cls: type[ProcessException]) -> type[ProcessException] | None:
    """The class derived from ``cls`` and torch's counterpart, or None without torch loaded."""
    spawn = sys.modules.get("torch.multiprocessing.spawn")
    if spawn is None:
        return None
    ours, torch_name = next((c, name) for c, name in _COUNTERPARTS if issubclass(cls, c))
    torchs = getattr(spawn, torch_name, None)
    if not isinstance(torchs, type) or not issubclass(torchs, Exception):
        return None  # torch's module is still being imported, or has changed beyond recognition
    if issubclass(cls, torchs):
        return cls
    with _making:
        made = _made.get((cls, torchs))
        if made is None:
            made = _make(cls, ours, torchs)
            _made[cls, torchs] = made
    return made


def _make(
    cls: type[ProcessException], ours: type[ProcessException], torchs: type[Exception]
) -> type[ProcessException]:
    def __reduce__(self: ProcessException) -> tuple[Any, ...]:
        _, args, state = cls.__reduce__(self)
        return rebuild, (cls, args), state

    # Named as users know the class: aiospawn.ProcessRaisedException (the
    # facade gives public classes that module on first lookup).
    public = getattr(sys.modules["aiospawn"], cls.__name__, None) is cls
    namespace = {
        "__module__": "aiospawn" if public else cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": (
            f"aiospawn's {ours.__name__}, also torch.multiprocessing's {torchs.__name__}"
            " (see aiospawn._torch_errors)."
        ),
        "__reduce__": __reduce__,
    }
    made: type[ProcessException] = type(cls.__name__, (cls, _TorchInitSkipped, torchs), namespace)
    return made
