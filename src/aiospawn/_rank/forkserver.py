"""What ``multiprocessing``'s fork server imports for aiospawn, once, before it forks ranks.

The rank bootstrap, and what an ``async def fn`` needs of ours (its async
main and its awaited channel), so that no ``forkserver`` rank imports them
again (``forked``, a ``fork`` rank's hygiene, is not among them: no
``forkserver`` rank runs it); ``multiprocessing.popen_forkserver``, which
every rank's arguments name (the descriptors passed to it, its result pipe
and channel, are its ``_DupFd`` objects), so that unpickling them imports
nothing (about 0.3 ms of each rank's CPU before ``fn``). Then the server's
heap is frozen (``gc.freeze``), as a warm template's is: what the
server imported is never freed, and a rank's collections would otherwise
walk those objects, which writes to every page that holds one, so each rank
copied pages it could have shared. Imported by the fork server alone (see
``aiospawn._local._forkserver``), last in its preload list, so the objects of
the program's own preloaded modules are frozen too: freezing is for a process
that forks, and importing this module anywhere else would freeze that process.
"""

from __future__ import annotations

import contextlib
import gc

# Never the reason the rest is not preloaded: the fork server drops a module
# whose import fails, and this one holds the bootstrap and the freeze.
with contextlib.suppress(ImportError):
    from multiprocessing import popen_forkserver as popen_forkserver

from . import async_channel as async_channel
from . import async_main as async_main
from . import bootstrap as bootstrap

gc.collect()
gc.freeze()
