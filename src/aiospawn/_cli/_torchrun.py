"""torchrun's command line, as ``aiospawn run`` reads it.

A torchrun command line should run with only the program name changed. On the
parsing side that takes four things, all here:

- **spellings**: every option that torchrun spells with underscores is also
  accepted so (``--nproc_per_node`` beside ``--nproc-per-node``);
- **stream choices**: ``-r/--redirects`` and ``-t/--tee`` take torchrun's
  values, one for every rank (``3``) or per rank (``0:3,1:1``), read into a
  :class:`Std`;
- **``--tee``'s value**: torchrun's takes one, aiospawn's older one none;
  :func:`attach_tee_values` tells them apart before argparse sees the line;
- **the rendezvous flags** (:data:`RENDEZVOUS_FLAGS`): parsed, so that the
  plan can accept the values that describe one machine and refuse the others
  with the reason, where argparse would only say "unrecognized arguments".

``docs/cli-torchrun.md`` lists every torchrun flag and what ``aiospawn run``
does with it.
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from collections.abc import Collection, Sequence

__all__ = [
    "RENDEZVOUS_FLAGS",
    "STD_PATTERN",
    "TEE_FILES",
    "Std",
    "attach_tee_values",
    "spellings",
    "std",
    "tee",
]

#: ``--tee`` alone, aiospawn's older spelling: tee every stream that goes to files.
TEE_FILES = "files"

#: torchrun's Std values: one for all ranks (``3``), or per rank (``0:3,1:1``).
STD_PATTERN = re.compile(r"[0-3]|\d+:[0-3](,\d+:[0-3])*")

#: torchrun's rendezvous and logging flags, with their metavars and help (None:
#: hidden); each is parsed as text and judged by the plan (``_nodes`` for the
#: multi-node ones).
RENDEZVOUS_FLAGS: tuple[tuple[str, str, str | None], ...] = (
    ("--nnodes", "N|MIN:MAX", "number of nodes, each running this command line (default 1)"),
    ("--node-rank", "K", "this node's rank, 0..N-1, for the static rendezvous"),
    ("--master-addr", "HOST", "node 0's address, for the static rendezvous (default 127.0.0.1)"),
    ("--master-port", "PORT", "node 0's port, for the static rendezvous (default 29500)"),
    ("--monitor-interval", "SECONDS", None),
    ("--rdzv-backend", "NAME", "static (the default) or c10d"),
    ("--rdzv-endpoint", "HOST:PORT", "the rendezvous's store (c10d: the same on every node)"),
    ("--rdzv-conf", "CONF", "KEY=VALUE,... for torch's rendezvous (join_timeout=600, ...)"),
    ("--local-addr", "HOST", None),
    ("--logs-specs", "NAME", None),
    ("--duplicate-stdout-filters", "TEXT", None),
    ("--duplicate-stderr-filters", "TEXT", None),
    ("--numa-binding", "MODE", None),
)


def spellings(*names: str) -> list[str]:
    """Each option name, and torchrun's underscore spelling of it where that differs."""
    spelled = []
    for name in names:
        spelled.append(name)
        if name.startswith("--") and "-" in name[2:]:
            spelled.append("--" + name[2:].replace("-", "_"))
    return spelled


class Std:
    """A torchrun stream choice: 0 none, 1 stdout, 2 stderr, 3 both; per rank or for all."""

    NAMES: ClassVar[dict[int, str]] = {1: "stdout", 2: "stderr"}

    def __init__(self, default: int, per_rank: dict[int, int]) -> None:
        self.default = default
        self.per_rank = per_rank

    def streams(self, rank: int) -> frozenset[str]:
        """The streams this choice names for ``rank``."""
        value = self.per_rank.get(rank, self.default)
        return frozenset(name for bit, name in self.NAMES.items() if value & bit)

    def __repr__(self) -> str:
        return f"Std({self.default}, {self.per_rank})"


def std(text: str) -> Std:
    """The value of ``-r/--redirects``: ``0``-``3``, or per rank as ``0:3,1:1``."""
    if not STD_PATTERN.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"wants 0, 1, 2 or 3 (none, stdout, stderr, both), or per rank as 0:3,1:1; got {text!r}"
        )
    if ":" not in text:
        return Std(int(text), {})
    per_rank: dict[int, int] = {}
    for item in text.split(","):
        rank, _, value = item.partition(":")
        if int(rank) in per_rank:
            raise argparse.ArgumentTypeError(f"names rank {int(rank)} twice: {text!r}")
        per_rank[int(rank)] = int(value)
    # torchrun: a rank the map leaves out gets 0 (nothing).
    return Std(0, per_rank)


def tee(text: str) -> Std | str:
    """The value of ``-t/--tee``: as :func:`std`, or :data:`TEE_FILES` for a bare ``--tee``."""
    return TEE_FILES if text == TEE_FILES else std(text)


def attach_tee_values(options: Sequence[str], takes_value: Collection[str]) -> list[str]:
    """Spell ``-t``/``--tee`` with its value attached, before argparse sees it.

    torchrun's ``--tee`` takes a value (``3``, ``0:3,1:1``), aiospawn's takes
    none; a value is the next word only if it reads as one, so ``--tee
    script.py`` stays a bare ``--tee`` (``--tee=files``). Only the options
    before TARGET are looked at: what follows it is the target's.

    Args:
        options: The words after ``run``.
        takes_value: The option strings of ``run`` that take a value, so that
            such a value (``--role worker``) is never mistaken for TARGET.
    """
    out: list[str] = []
    index = 0
    while index < len(options):
        word = options[index]
        index += 1
        if word in ("-t", "--tee"):
            if index < len(options) and STD_PATTERN.fullmatch(options[index]):
                out.append(f"--tee={options[index]}")
                index += 1
            else:
                out.append(f"--tee={TEE_FILES}")
            continue
        out.append(word)
        if word == "--" or not word.startswith("-"):
            break  # TARGET: the rest is its own
        if word in takes_value and index < len(options):
            out.append(options[index])
            index += 1
    return out + list(options[index:])
