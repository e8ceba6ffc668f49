"""Files that appear whole or not at all: written under a hidden temporary name beside the target, then renamed.

A reader (another process, a resumed run) never sees half a file; a writer killed mid-write leaves the old file
as it was. Used for every small file the project replaces in place: markers, configs, metrics, exchange payloads.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: str | Path, content: str | bytes | Callable[[BinaryIO], None], durable: bool = False) -> None:
    """Replaces `path` with `content` (text as UTF-8, bytes, or a function writing to the open binary file).
    `durable`: fsync before the rename, so a machine crash cannot leave an empty file either. A write that fails
    (a full disk, an interrupt) removes its temporary file and leaves `path` untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
