"""Named points where a test pauses a command (JAXLM_PAUSE_AT=NAME), so that it can signal it mid-write.

Signalling a command at a random moment hits the interesting window (a half-written shard, an export's scratch
directory) only by luck; a pause point makes the catalogue of careless inputs and the signal tests deterministic.
The command prints `paused at NAME` on stdout and sleeps, interruptibly, until it is signalled.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Callable

PAUSE_ENV = "JAXLM_PAUSE_AT"


def pause_point(name: str, until: Callable[[], object] | None = None) -> None:
    """Pauses here when JAXLM_PAUSE_AT names this point: until a signal interrupts the sleep, or, for code whose
    handler only records the signal (training's), until `until()` is true."""
    if os.environ.get(PAUSE_ENV) != name:
        return
    sys.stdout.write(f"paused at {name}\n")
    sys.stdout.flush()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (until and until()):
        time.sleep(0.05)
