"""Named points where a test pauses a command (JAXLM_PAUSE_AT=NAME), so that it can signal it mid-write.

Signalling a command at a random moment hits the interesting window (a half-written shard, an export's scratch
directory) only by luck; a pause point makes the catalogue of careless inputs and the signal tests deterministic.
The command prints `paused at NAME` on stdout and sleeps, interruptibly, until it is signalled.
"""

from __future__ import annotations

import os
import sys
import time

PAUSE_ENV = "JAXLM_PAUSE_AT"


def pause_point(name: str) -> None:
    if os.environ.get(PAUSE_ENV) != name:
        return
    sys.stdout.write(f"paused at {name}\n")
    sys.stdout.flush()
    time.sleep(600)
