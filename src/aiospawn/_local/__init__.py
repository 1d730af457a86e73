"""The local backend: a group's ranks as child processes of the supervising one.

``_backend.LocalBackend`` is the default backend. Its check refuses, before
anything starts, what local processes cannot run, and chooses the group's
start strategy (``_strategy``: ``spawn``, ``forkserver``, ``fork``, or a warm
start from a template: ``_template``, leased from the table ``_templates``),
which holds every way the start methods differ; ``_starters`` runs the
starts. ``_launcher.LocalLauncher`` makes each rank and hands it a
private result pipe, a channel, stream pipes and a heartbeat slot
(``_pipes``, ``_link``, ``_output``, ``_progress``); ``_rank.LocalRank``
watches its exit through a pidfd or sentinel on the event loop. ``_limits``
holds this process's limits and devices, ``_pickling`` how ``fn`` and
``args`` are pickled for a rank.

Import rule: this package may import the standard library, anyio,
cloudpickle (only when something goes by value), ``aiospawn._core`` (the
seam it implements, and the checks every backend shares) and
``aiospawn._rank`` (the bootstrap it starts); never ``aiospawn.ray``,
``aiospawn._api``, ``aiospawn.sync`` or ``aiospawn._cli``. Nothing imports
it but the public surface (``aiospawn._api``, ``aiospawn.sync``,
``aiospawn._cli``), and ``aiospawn._imports`` names its modules for a first
call to import off the event loop. ``_backend``, ``_strategy`` (with ``_starters``),
``_limits`` and ``_pickling`` are light: the entry points use them before the supervisor's
modules are imported.
"""
