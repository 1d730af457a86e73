"""Code that runs inside a rank's process.

Everything here runs before, around or beside the user's ``fn`` in every
rank, so it imports the **standard library only**, and nothing of the
supervisor (no anyio, no asyncio, nothing from ``aiospawn._core``,
``aiospawn._local`` or ``aiospawn.ray``): a rank costs the interpreter plus
the user's own imports. Not even ``typing`` (about 2 ms of a ``spawn``
rank's start): the modules' annotations are for the checker only, under a
module-level ``TYPE_CHECKING = False``. ``tests/test_public_api.py`` checks
these rules in a clean interpreter.

- ``bootstrap``: :func:`~aiospawn._rank.bootstrap.run_rank`, the
  ``multiprocessing`` target of a local rank, and its guards.
- ``api``: what the rank's own code calls (``aiospawn.heartbeat()``,
  ``aiospawn.restart_count()``, ``aiospawn.ready()``, ``aiospawn.channel()``,
  ``aiospawn.serve()``).
- ``channel``: the rank's end of its channel to the supervisor (messages,
  readiness, calls), blocking in a sync rank, awaitable in an async one.
- ``wire``: what a rank and its supervisor agree on (the outcome frame, its
  encoders, shared constants).
- ``programs``: the rank functions behind ``aiospawn run``.
- ``descendants``: the processes a rank started, wherever they went: found
  through ``/proc`` and killed when the rank ends (the supervisor uses it to
  signal them too).
- ``template``: a warm-start template's own loop (``preload=``): it imports
  the preload once, then forks ranks that run the same bootstrap.
- ``forkserver``: what ``multiprocessing``'s fork server imports for a
  ``forkserver`` group: the bootstrap, then its heap frozen.
"""
