"""The local backend: a group's ranks as child processes of the supervising one.

``_launcher.LocalBackend`` is the default backend. It makes each rank with a
``multiprocessing`` start method (``spawn``, ``forkserver``, ``fork``), hands
it a private result pipe, stream pipes and a heartbeat slot (``_output``,
``_progress``, ``_pipes``), and watches its exit through a pidfd on the event
loop (``_rank.LocalRank``).

Import rule: this package may import the standard library, anyio,
``aiospawn._core`` (the seam it implements) and ``aiospawn._rank`` (the
bootstrap it starts). Nothing imports it but the public surface
(``aiospawn._api``, ``aiospawn.sync``, ``aiospawn._cli``).
"""
