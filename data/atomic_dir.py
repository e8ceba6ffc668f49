"""Dataset directories that appear whole or not at all: built in a temp dir beside the target, then renamed.

A killed writer leaves nothing where readers look; an existing directory of another kind is never overwritten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import tempfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class DirKind:
    """One kind of dataset directory, recognised by the `format` field of its JSON `marker` file."""

    name: str  # "token file", "shard dataset"
    marker: str
    format: str
    error: type[Exception]
    overwrite_hint: str = "pass overwrite=True to replace it"
    files: str = ".*"  # a regex of the file names a dataset of this kind consists of: all that overwrite may delete

    def is_one(self, path: Path) -> bool:
        try:
            return json.loads((path / self.marker).read_text()).get("format") == self.format
        except (OSError, ValueError, AttributeError):
            return False

    def read_marker(self, path: Path, version: int) -> dict:
        """The parsed marker file of the dataset at `path`, checked for format and version."""

        def fail(problem: str):
            raise self.error(f"{path}: {problem}")

        try:
            marker = json.loads((path / self.marker).read_text())
        except FileNotFoundError:
            fail(f"missing {self.marker}")
        except json.JSONDecodeError as e:
            fail(f"{self.marker} is not valid JSON ({e})")
        except (OSError, UnicodeDecodeError) as e:
            fail(f"cannot read {self.marker}: {e}")
        if not isinstance(marker, dict) or marker.get("format") != self.format:
            got = marker.get("format") if isinstance(marker, dict) else type(marker).__name__
            fail(f"{self.marker} format is {got!r}, expected {self.format!r}")
        if marker.get("version") != version:
            fail(f"unsupported version {marker.get('version')!r}, expected {version}")
        return marker

    def check_writable(self, out_dir: Path, overwrite: bool) -> None:
        if not out_dir.exists():
            return
        if not out_dir.is_dir():
            raise self.error(f"{out_dir}: output exists and is not a directory")
        if not any(out_dir.iterdir()):
            return
        if not self.is_one(out_dir):
            raise self.error(
                f"{out_dir}: output directory is not empty and is not a {self.name}; refusing to overwrite it"
            )
        if not overwrite:
            raise self.error(f"{out_dir}: {self.name} already exists ({self.overwrite_hint})")
        others = sorted(p.name for p in out_dir.iterdir() if not re.fullmatch(self.files, p.name) or p.is_dir())
        if others:
            shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
            raise self.error(
                f"{out_dir}: holds files that are not part of the {self.name} ({shown}); overwriting would delete "
                f"them: move them out or write the {self.name} elsewhere"
            )

    @contextlib.contextmanager
    def build(self, out_dir: Path, overwrite: bool):
        """Yields a temp dir to write into; on a clean exit it replaces `out_dir` (an old one is deleted)."""
        self.check_writable(out_dir, overwrite)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp's 0700 would make the result private after the rename
            yield tmp
            self._move_into_place(tmp, out_dir, overwrite)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def publish(self, built: Path, out_dir: Path, overwrite: bool) -> None:
        """Moves a directory built elsewhere (a resumable build, not `build`'s temp dir) into place at `out_dir`."""
        self._move_into_place(built, out_dir, overwrite)

    def _move_into_place(self, tmp: Path, out_dir: Path, overwrite: bool) -> None:
        old = None
        if out_dir.exists() and any(out_dir.iterdir()):
            self.check_writable(out_dir, overwrite)  # may have appeared while we were writing
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "x")
        try:
            os.replace(tmp, out_dir)  # atomic; fails if another writer got there first
        except OSError as e:
            raise self.error(
                f"{out_dir}: could not move the new {self.name} into place ({e}); another process may have written it"
            ) from e
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
