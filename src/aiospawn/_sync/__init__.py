"""What ``aiospawn.sync`` is made of: blocking calls over a private event loop.

``aiospawn.sync`` keeps torch's names, signatures and docstrings; the
machinery under them lives here, one concern a module:

- ``_interrupts``: Ctrl-C while a blocking call waits in the main thread,
  counted and raised at one point instead of wherever it lands.
- ``_portal``: an event loop on a private daemon thread, and the hand-off of
  a coroutine function to it, which no interruption of the caller can strand.
- ``_blocking_group``: a group started, joined and terminated through the
  portal, and the outcome ``join()`` reports, whatever point an
  interruption hit.
- ``_loop_guard``: the refusal to block a thread that runs an event loop
  (a notebook's synchronous cell excepted).

Import rule: ``_interrupts`` and ``_portal`` import the standard library and
anyio only (``_portal`` also ``_interrupts``), so they can be tested without
a group. ``_blocking_group`` and ``_loop_guard`` may also import
``aiospawn._core``, ``aiospawn._api`` (the async API that starts a
group) and ``aiospawn._torch_errors`` (a failure as torch's class too, once
torch is loaded). Nothing imports this package but ``aiospawn.sync``.
"""
