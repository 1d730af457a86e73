"""Run in a fresh interpreter by tests/test_torch_errors.py: aiospawn.sync's failures and torch.

``python -m tests.torch_errors_probe`` makes a rank fail through
``aiospawn.sync.spawn`` before torch is imported, then imports torch and makes
ranks fail again, caught by plain ``except torch.multiprocessing...`` clauses;
it prints one JSON object. torch is imported only inside :func:`main`: the
ranks (``spawn``) import this module as their ``__main__``, and stay cheap.
"""

from __future__ import annotations

import json
import pickle
import sys
from typing import Any


def spawn_failing(how: str) -> None:
    """Run two ranks under ``spawn``: rank 1 does ``how`` (a crash row), rank 0 waits."""
    import aiospawn.sync as mp
    from tests import ranks

    mp.spawn(ranks.crash_row, args=(how, 1), nprocs=2)
    raise AssertionError(f"no rank failed ({how})")


def main() -> dict[str, Any]:
    import aiospawn

    report: dict[str, Any] = {}
    try:
        spawn_failing("raise ValueError")
    except aiospawn.ProcessRaisedException as exc:
        report["before"] = {
            "aiospawns_own_class": type(exc) is aiospawn.ProcessRaisedException,
            "torch_loaded": "torch" in sys.modules,
        }

    import torch.multiprocessing
    from torch.multiprocessing.spawn import ProcessException  # torch's root class, by import

    try:
        spawn_failing("raise ValueError")
    except torch.multiprocessing.ProcessRaisedException as exc:
        copy = pickle.loads(pickle.dumps(exc))
        report["raised"] = {
            "aiospawn": isinstance(exc, aiospawn.ProcessRaisedException),
            "class": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "index": exc.error_index,
            "cause": repr(exc.__cause__),
            "pickled": {
                "torch": isinstance(copy, torch.multiprocessing.ProcessRaisedException),
                "aiospawn": isinstance(copy, aiospawn.ProcessRaisedException),
                "fields": [copy.msg == exc.msg, copy.error_index, copy.error_pid == exc.error_pid],
            },
        }
    try:
        spawn_failing("sys.exit(3)")
    except torch.multiprocessing.ProcessExitedException as exc:
        report["exited"] = {
            "aiospawn": isinstance(exc, aiospawn.ProcessExitedException),
            "index": exc.error_index,
            "exit_code": exc.exit_code,
            "signal_name": exc.signal_name,
        }
    try:
        spawn_failing("SIGKILL")
    except ProcessException as exc:
        report["killed"] = {
            "class": type(exc).__name__,
            "aiospawn": isinstance(exc, aiospawn.ProcessExitedException),
            "signal_name": getattr(exc, "signal_name", None),
        }
    return report


if __name__ == "__main__":
    print(json.dumps(main()))
