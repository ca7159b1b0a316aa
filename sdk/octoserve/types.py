"""The enums of the public API, shared by the SDK and the node (no dependencies)."""

from __future__ import annotations

import enum


class Priority(enum.IntEnum):
    """Service tier. Lower value is more urgent; the order is used directly by queue policies."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens or the context window reached
    ABORT = "abort"  # cancelled by the client or the router
    HANDOFF = "handoff"  # prefill role only: the prompt is done, KV is ready to move to a decode instance
