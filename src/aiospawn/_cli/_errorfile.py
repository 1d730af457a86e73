"""torchrun's error file: the root cause's error, as JSON, for tools that read it.

torchrun sets ``TORCHELASTIC_ERROR_FILE`` in each worker to a file of its own;
torch's ``@record`` decorator writes the worker's exception there. When a run
fails, torchrun copies the root cause's file to its own
``TORCHELASTIC_ERROR_FILE``, if one is set for it (a scheduler that runs
torchrun reads it). The shape, from torch's ``ErrorHandler``::

    {"message": {"message": "ValueError: bad shard",
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1795986218"},
                 "errorCode": 1}}

``errorCode`` is added only when the exit code is not 0, the timestamp is a
string of whole seconds. aiospawn does the same; a rank without ``@record``
still gets a file, since its exception came back through the result channel.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import aiospawn

from ._plan import error_file

__all__ = ["ERROR_FILE_VAR", "root_cause_error", "write_root_cause"]

#: The variable naming the error file, in the launcher and in each rank.
ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"


def write_root_cause(failure: BaseException | None, error_files: str | None) -> str | None:
    """Write the root cause of ``failure`` to the launcher's error file, if it has one.

    Args:
        failure: The run's failure; nothing is written without one.
        error_files: The stem of the ranks' own error files, if they had any.

    Returns:
        The path written, or None.
    """
    target = os.environ.get(ERROR_FILE_VAR)
    if not target or not isinstance(failure, aiospawn.ProcessException):
        return None
    data = root_cause_error(failure, error_files)
    # As torch's dump_error_file: an older file there is replaced.
    with contextlib.suppress(FileNotFoundError):
        os.remove(target)
    with open(target, "w", encoding="utf-8") as file:
        json.dump(data, file)
    return target


def root_cause_error(failure: aiospawn.ProcessException, error_files: str | None) -> dict[str, Any]:
    """The error file's content for ``failure``: the rank's own file if it wrote one."""
    code = _exit_code(failure)
    written = _rank_file(error_files, failure.error_index)
    if written is not None:
        message = written.get("message")
        if code and isinstance(message, dict):
            message["errorCode"] = code
        return written
    error: dict[str, Any] = {
        "message": _message(failure),
        "extraInfo": {
            "py_callstack": _callstack(failure),
            "timestamp": str(int(time.time())),
        },
    }
    if code:
        error["errorCode"] = code
    return {"message": error}


def _rank_file(error_files: str | None, rank: int) -> dict[str, Any] | None:
    if error_files is None:
        return None
    try:
        with open(error_file(error_files, rank), encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, ValueError):  # none written, or cut short by the rank's death
        return None
    return data if isinstance(data, dict) and "message" in data else None


def _exit_code(failure: aiospawn.ProcessException) -> int:
    if isinstance(failure, aiospawn.ProcessExitedException):
        return failure.exit_code
    return 1


def _message(failure: aiospawn.ProcessException) -> str:
    cause = failure.__cause__
    if isinstance(failure, aiospawn.ProcessRaisedException) and cause is not None:
        if isinstance(cause, aiospawn.RemoteTraceback):
            last = cause.traceback.rstrip("\n").splitlines()
            return last[-1] if last else cause.type_name
        return f"{type(cause).__name__}: {cause}"
    if isinstance(failure, aiospawn.ProcessExitedException) and failure.signal_name:
        # torchrun's words for a worker that a signal ended.
        signum = -failure.exit_code
        return f"Signal {signum} ({failure.signal_name}) received by PID {failure.error_pid}"
    return str(failure).strip().splitlines()[0]


def _callstack(failure: aiospawn.ProcessException) -> str:
    if isinstance(failure, aiospawn.ProcessRaisedException):
        text = failure.msg.lstrip("\n")
        header, _, rest = text.partition("\n")
        # Without the "-- Process N terminated with the following error:" line.
        return rest if header.startswith("-- Process") else text
    return ""
