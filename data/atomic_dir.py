"""Dataset directories that appear whole or not at all: built in a temp dir beside the target, then renamed.

A killed writer leaves nothing where readers look; an existing directory of another kind is never overwritten.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import json
import os
import re
import shutil
import socket
import tempfile
from pathlib import Path

from data.command_signals import signals_deferred


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
        with signals_deferred():  # a stop between the two renames would leave neither the old nor the new in place
            self._swap(tmp, out_dir, overwrite)

    def _swap(self, tmp: Path, out_dir: Path, overwrite: bool) -> None:
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


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs on this host; a zombie (killed, not yet reaped) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] != "Z"
    except (OSError, ValueError, IndexError):
        return True


def scratch_path(target: Path, tag: str) -> Path:
    """Where a command builds `target` before renaming it into place: beside it, hidden, named by host and pid so
    that a later run can tell an abandoned one (its writer gone) from a live one."""
    target = Path(os.path.abspath(target))
    return target.parent / f".{target.name}.{tag}-{socket.gethostname()}-{os.getpid()}"


def remove_abandoned(target: Path, tag: str) -> list[Path]:
    """Removes the scratch copies of `target` left by writers of this host that are gone (killed, or stopped
    past their grace period); returns them."""
    target = Path(os.path.abspath(target))
    prefix = f".{target.name}.{tag}-{socket.gethostname()}-"
    removed = []
    if not target.parent.is_dir():
        return removed
    for p in target.parent.glob(f"{glob.escape(prefix)}*"):
        pid = p.name[len(prefix) :]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p)
    return removed


NO_SPACE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file-size limit


def rust_os_error(e: BaseException, path: Path) -> OSError | None:
    """The OSError behind a Rust library's error (tokenizers, safetensors: "... (os error 28)"), so that a full
    disk reads the same whichever library wrote; None if `e` is not one."""
    code = re.search(r"os error (\d+)", str(e))
    return OSError(int(code[1]), os.strerror(int(code[1])), str(path)) if code else None


def no_space(e: BaseException, where: Path, needed_bytes: int | None = None, name=None) -> str | None:
    """One line for a write that failed for want of space (None for any other error): the output (`name`, else
    the file that failed), the reason, and how much the output needs against what is free where it is written."""
    if not isinstance(e, OSError) or e.errno not in NO_SPACE:
        return None
    return space_line(name or e.filename or where, e.strerror, where, needed_bytes)


NO_SPACE_TEXT = ("No space left on device", "File too large", "Disk quota exceeded")  # as strerror words them


def space_line(path, reason: str, where: Path, needed_bytes: int | None = None) -> str:
    """The line for a write to `path` that failed for want of space: the reason, and `room`."""
    return f"cannot write {path}: {reason} ({room(where, needed_bytes)})"


def room(where: Path, needed_bytes: int | None = None) -> str:
    """How much an output needs (when known) against what is free on the filesystem of `where`."""
    where = Path(os.path.abspath(where))
    existing = next((p for p in (where, *where.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(existing).free
    need = f"it needs about {_size(needed_bytes)}; " if needed_bytes else ""
    return f"{need}{_size(free)} free on {existing}'s filesystem"


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
