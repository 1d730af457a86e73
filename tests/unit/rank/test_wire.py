"""The frame format (``_rank.wire``): a sender refuses a payload beyond a frame's limit.

Reassembling and checking a frame is ``test_reader``'s; reading frames off a
socket, ``test_stream``'s.
"""

from __future__ import annotations

import pytest

from aiospawn._rank.wire import MAX_FRAME_BYTES, check_size


def test_a_sender_refuses_a_payload_beyond_the_limit() -> None:
    check_size(MAX_FRAME_BYTES)
    with pytest.raises(ValueError, match=f"more than a channel frame carries \\({MAX_FRAME_BYTES}"):
        check_size(MAX_FRAME_BYTES + 1)
