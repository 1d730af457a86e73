"""A ``memoryview`` in a message or a result: pickled as the buffer it views, rebuilt as a view.

Plain pickle refuses a ``memoryview``. A channel sends one as a
``pickle.PickleBuffer`` of its bytes (so a large one goes through shared
memory, as any out-of-band buffer does; see ``buffers``) with its format,
shape and read-only flag, and the receiver gets a ``memoryview`` of the same
format, shape and flag. That matters because a ``pickle.PickleBuffer`` of
``buffers.SHARED_BYTES`` or more arrives as a ``memoryview`` of the mapping:
without this, an echo of it failed. A view that is not C-contiguous is copied
into its bytes in C order first.

Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import copyreg
import pickle

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

#: The formats a view is rebuilt in (``memoryview.cast`` takes these alone):
#: struct's native single characters.
_FORMATS = frozenset("cbB?hHiIlLqQnNfdP")


def dispatch_table() -> dict[Any, Any]:
    """``copyreg``'s reducers as they are now, and the one for ``memoryview``.

    For a pickler's own ``dispatch_table``: set, it replaces ``copyreg``'s,
    so the copy keeps what the program registered there.
    """
    table: dict[Any, Any] = dict(copyreg.dispatch_table)
    table[memoryview] = reduce_view
    return table


def reduce_view(view: memoryview) -> tuple[Any, tuple[Any, ...]]:
    """``(rebuild_view, args)`` for ``view``.

    Raises:
        TypeError: The receiver could not rebuild it: its format is not one
            of struct's native single characters (a numpy structured dtype's,
            for one), or it is empty with more than one dimension (a cast
            takes no shape with a zero). Pass the object it views instead.
    """
    if view.format.removeprefix("@") not in _FORMATS:
        raise TypeError(
            f"cannot pickle a memoryview of format {view.format!r}: pass the object it views"
            " (such as the numpy array), or view.cast('B')"
        )
    if view.ndim > 1 and 0 in (view.shape or ()):
        raise TypeError(
            f"cannot pickle an empty memoryview of shape {view.shape}: pass the object it"
            " views (such as the numpy array)"
        )
    if view.c_contiguous:
        data: Any = pickle.PickleBuffer(view)
    else:  # its bytes in C order: writable if the view was
        data = view.tobytes() if view.readonly else bytearray(view.tobytes())
    return rebuild_view, (data, view.format, view.shape, view.readonly)


def rebuild_view(data: Any, format: str, shape: tuple[int, ...], readonly: bool) -> memoryview:
    """The receiver's ``memoryview``: over the buffer that came, as the sender's was."""
    view = memoryview(data)
    if view.format != format or view.shape != shape:
        # typeshed knows each format by its literal alone; it was checked when
        # sent. An empty view is one-dimensional (others were refused): a cast
        # takes no shape with a zero in it.
        flat = view.cast("B")
        view = (
            flat.cast(format)  # type: ignore[call-overload]
            if 0 in shape
            else flat.cast(format, shape)  # type: ignore[call-overload]
        )
    if readonly and not view.readonly:
        view = view.toreadonly()
    return view
