"""An import that lasts until the test lets it end, as a slow ``import torch`` would.

With ``$WARM_GATE`` set to the path of a listening Unix socket, the import
connects to it (the test's ``accept()`` is the handshake: the import has
begun) and waits until the test closes the connection. Without it, or once
nobody listens there any more, the import ends at once.
"""

from __future__ import annotations

import os
import socket

_gate = os.environ.get("WARM_GATE")
if _gate:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as _sock:
        try:
            _sock.connect(_gate)
            while _sock.recv(1024):
                pass
        except OSError:
            pass  # the gate is open: nobody listens, or it closed before it accepted us
