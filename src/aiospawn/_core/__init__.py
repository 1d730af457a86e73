"""Supervision of a rank group, independent of where its ranks run.

The group supervisor (fail-fast, shutdown escalation, restarts, hang
detection, events, results and errors) talks to ranks only through the
backend seam in ``_backend`` (``Backend`` -> ``GroupLauncher`` ->
``RankHandle``); it knows nothing of processes, pipes or Ray.

Where things are: ``_context`` is the public handle, ``AsyncProcessContext``;
``_group`` the supervisor behind it, which drives the group's state machine;
``_live`` the live ranks' channels and calls; ``_restarts`` and ``_hangs``
its decisions (pure functions of a snapshot) and the objects that carry them
out for it;
``_outcome`` how ranks ended and the exceptions and results built from that;
``_shutdown`` the escalation; ``_spec`` what a group runs and the checks of
the user's arguments that hold on every backend (each backend refuses the rest
itself: ``_backend.Backend.check``); ``_concurrency`` the small tools the rest
share; ``_loops`` which event loop runs the caller.

Import rule: this package imports the standard library, anyio, and of the
rest of aiospawn only ``aiospawn._rank.wire`` (the outcome frame a rank
sends, which every backend hands back as it is) and ``aiospawn._rank.buffers``
(how a frame's large buffers travel in a memfd). It never imports
``aiospawn._local``, ``aiospawn.ray``, ``aiospawn._api``, ``aiospawn.sync``,
``aiospawn._cli`` or the rank bootstrap, nor ``multiprocessing`` or
``resource`` (how local processes are made, what is pickled for them, how
many this process may hold: the local backend's), nor any other package
(``cloudpickle``, ``ray``). ``tests/test_public_api.py`` checks this rule on
every import statement, deferred ones included.
"""
