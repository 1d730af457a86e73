"""Code that runs inside a rank's process.

Everything here runs before, around or beside the user's ``fn`` in every
rank, so it imports the **standard library only**, and nothing of the
supervisor (no anyio, nothing from ``aiospawn._core``, ``aiospawn._local``
or ``aiospawn.ray``), and no event loop either, but for the rank whose ``fn``
is a coroutine function (``async_main`` and what it uses import asyncio or
trio when it runs): a rank costs the interpreter plus the user's own
imports. Not even ``typing`` (about 2 ms of a ``spawn`` rank's start): the
modules' annotations are for the checker only, under a module-level
``TYPE_CHECKING = False``. ``tests/test_public_api.py`` checks
these rules in a clean interpreter.

What a local rank runs, in order (a plain ``spawn`` rank imports these
modules, and no more of ours):

- ``bootstrap``: :func:`~aiospawn._rank.bootstrap.run_rank`, the
  ``multiprocessing`` target of a local rank: the order of its life, its
  result pipe, and how its process ends.
- ``payload``: what a ``spawn`` or ``forkserver`` rank unpickles before
  ``fn``: its environment, carried by its name, and ``fn`` with ``args``.
- ``process``: the rank's process set up before ``fn`` (``RankSetup``).
- ``guard``: the guard that kills the rank once its supervisor is gone.
- ``fds``: the rank's own descriptors, moved out of ``fn``'s way and
  recognised again.
- ``outcome``: the one rule from how ``fn`` ended to the outcome frame and
  exit status, shared with Ray ranks (``aiospawn.ray._actor``).
- ``descendants``: the processes a rank started, wherever they went: found
  through ``/proc`` and killed when the rank ends (the supervisor uses it to
  signal them too).
- ``api``: what the rank's own code calls (``aiospawn.heartbeat()``,
  ``aiospawn.restart_count()``, ``aiospawn.ready()``, ``aiospawn.channel()``,
  ``aiospawn.serve()``), and the state they read, set in one place.
- ``channel``: the rank's end of its channel to the supervisor (messages,
  readiness, calls), blocking in a sync rank.
- ``frames``: the socket under a rank's channel, blocking or awaited: frames
  queued and written, read and sorted by kind.
- ``stream``: a channel's socket as frames, at either end (the supervisor's
  ``aiospawn._local._link`` too): queued whole, read many at a time.
- ``reader``: one frame reassembled and its header checked (the supervisor
  reads outcome frames with it too).
- ``buffers``: large buffers in a memfd that travels with a frame;
  ``tensors``: torch tensors pickled as such buffers, once torch is imported.
- ``wire``: what a rank and its supervisor agree on (the outcome frame, its
  encoders, the channel's frames and their bounds, shared constants).

Imported only by the ranks that need them:

- ``forked``: a ``fork`` rank's hygiene (the supervisor's descriptors and
  its event loop's thread-locals, dropped).
- ``async_main``: an ``async def fn`` run on an event loop of its own.
- ``async_channel``: the channel awaited in an ``async def fn``.

And beside the ranks:

- ``programs``: the rank functions behind ``aiospawn run``.
- ``template``: a warm-start template's own loop (``preload=``): it imports
  the preload once, then forks ranks that run the same bootstrap.
- ``forkserver``: what ``multiprocessing``'s fork server imports for a
  ``forkserver`` group: the bootstrap, then its heap frozen.
"""
