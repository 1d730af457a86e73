"""Supervision of a rank group, independent of where its ranks run.

The group supervisor (fail-fast, shutdown escalation, restarts, hang
detection, events, results and errors) talks to ranks only through the
backend seam in ``_backend`` (``Backend`` -> ``GroupLauncher`` ->
``RankHandle``); it knows nothing of processes, pipes or Ray.

Import rule: this package imports the standard library, anyio, and of the
rest of aiospawn only ``aiospawn._rank.wire`` (the outcome frame a rank
sends, which every backend hands back as it is). It never imports
``aiospawn._local``, ``aiospawn.ray``, ``aiospawn._api``, ``aiospawn.sync``
or the rank bootstrap. ``tests/test_public_api.py`` checks this rule.
"""
