"""The package's logger, ``logging.getLogger("aiospawn")``, for operational events.

Escalation to SIGKILL, a rank ignoring SIGTERM, a failure absorbed by a
restart: things an operator wants in the logs. The library never prints.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("aiospawn")
