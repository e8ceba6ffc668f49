"""Orbax checkpoints of everything a run needs to continue exactly: train state, data-iterator state, config.

Crash safety, in three layers:
- Orbax writes a step into `N.orbax-checkpoint-tmp` and renames it to `N` when complete, so a process killed at
  any instant leaves only complete checkpoints under their step names. Leftover temporary directories are
  removed when the next run opens the directory.
- Each checkpoint carries an `integrity` item: a position-weighted sum of every leaf's bits, computed on the
  devices before the save. A restore recomputes it, so a flipped or truncated byte that Orbax reads without
  complaint is still caught. A state with a non-finite value is never saved.
- `restore_latest` walks back from the newest step: a checkpoint that cannot be read or fails verification is
  moved aside to `<dir>.corrupt/` (never deleted) with a log line, and the previous one is tried.
"""

from __future__ import annotations

import atexit
import gc
import inspect
import logging
import re
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

TMP_MARKER = ".orbax-checkpoint-tmp"
ITEMS = ("state", "data", "config", "integrity")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which and why in one line."""


class CheckpointCorrupt(CheckpointError):
    pass


class CheckpointSaveError(CheckpointError):
    """A save that failed; `cause` is the storage problem, short (e.g. "No space left on device")."""

    def __init__(self, message: str, cause: str = ""):
        super().__init__(message)
        self.cause = cause


class NonFiniteState(CheckpointSaveError):
    """A save refused because the state holds a non-finite value (the caller may add what made it so)."""


# ----------------------------------------------------------------------------- integrity


def _leaf_digest(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum over i of bits(x_i) * (2i + 1) mod 2**32, number of non-finite values). Integer sums are exact and
    associative, so the digest does not depend on the sharding; odd weights make any bit flip and any swap of two
    different values change it."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, unsigned) if x.dtype != jnp.bool_ else x
    weights = jnp.arange(x.size, dtype=jnp.uint32).reshape(x.shape) * jnp.uint32(2) + jnp.uint32(1)
    digest = jnp.sum(bits.astype(jnp.uint32) * weights, dtype=jnp.uint32)
    nonfinite = jnp.sum(~jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.zeros((), jnp.int32)
    return digest, nonfinite.astype(jnp.int32)


_digests = jax.jit(lambda leaves: [_leaf_digest(x) for x in leaves])


def integrity(state) -> dict[str, dict[str, int]]:
    """{leaf path: {"digest": int, "nonfinite": int}} of a (possibly sharded) pytree of arrays."""
    paths_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    digests = jax.device_get(_digests([leaf for _, leaf in paths_leaves]))
    return {dotted(path): {"digest": int(d), "nonfinite": int(n)} for (path, _), (d, n) in zip(paths_leaves, digests)}


def dotted(path) -> str:
    """A pytree key path as 'params.blocks.attn.wo.value', the same for a live state and Orbax's metadata tree."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


def shape_mismatches(saved_tree, abstract_state, limit: int = 3) -> list[str]:
    """'path: saved (shape) dtype, now (shape) dtype' for leaves whose shape or dtype differ (at most `limit`)."""
    saved = {dotted(p): m for p, m in jax.tree_util.tree_flatten_with_path(saved_tree)[0]}
    out = []
    for path, a in jax.tree_util.tree_flatten_with_path(abstract_state)[0]:
        name, m = dotted(path), saved.get(dotted(path))
        if m is None:
            out.append(f"{name}: not in the checkpoint")
        elif tuple(m.shape) != tuple(a.shape) or np.dtype(m.dtype) != np.dtype(a.dtype):
            out.append(f"{name}: saved {tuple(m.shape)} {np.dtype(m.dtype)}, now {tuple(a.shape)} {np.dtype(a.dtype)}")
        if len(out) == limit:
            break
    return out


# ----------------------------------------------------------------------------- orbax's own reports


def _raised_in_orbax(exc_info) -> bool:
    tb = exc_info[2] if exc_info and exc_info is not True else None
    while tb is not None:
        if "orbax" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


class _OneLineOrbaxFailures(logging.Filter):
    """Orbax reports one failed write many times, each with a traceback: from each of its threads, then from every
    abandoned asyncio task when it is collected (some only at exit, after the run's own one-line error). The
    abandoned-task reports are dropped. Its error records are held back, not printed: a failed save or restore
    reports them in its own one line (`held_back()`), and any still held at exit are printed then, one line each,
    so no error of Orbax's is ever lost."""

    def __init__(self):
        super().__init__()
        self.held: list[str] = []
        self.reported = False  # a failed save or restore has reported its one line

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio" and "exception was never retrieved" in record.getMessage().split("\n")[0]:
            # An abandoned future of a failed write, collected late: its error was raised in TensorStore, so it
            # carries no traceback to tell it Orbax's (jaxlm runs no asyncio of its own), and once printed after
            # the run's one line it was the last line of a disk-full exit. Dropped once a failure is reported.
            if not self.reported:
                self.held.append(" ".join(record.getMessage().split())[:300])
            return False
        if not _raised_in_orbax(record.exc_info):
            return True
        if record.getMessage().startswith("Task exception was never retrieved"):
            return False
        if record.levelno >= logging.ERROR:
            self.held.append(" ".join(record.getMessage().split())[:300])
            return False
        record.exc_info, record.exc_text = None, None
        return True

    def held_back(self) -> list[str]:
        """The held error lines, distinct, in order; they count as reported."""
        self.reported = True
        held, self.held = self.held, []
        return list(dict.fromkeys(held))

    def print_unreported(self) -> None:
        for line in self.held_back():
            print(f"orbax: {line}", file=sys.stderr)


_ONE_LINE = _OneLineOrbaxFailures()  # one instance: addFilter ignores it when it is already there


def _closed_loop_callback(unraisable) -> bool:
    """A tensorstore write finishing after Orbax closed the event loop that awaited it (a failed save): Python
    reports it as unraisable, with a traceback and no context, once per write."""
    error = unraisable.exc_value
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def _abandoned_read(unraisable) -> bool:
    """One of Orbax's parallel array reads, left unawaited when another read of the same restore failed, raising
    as it is garbage-collected (often minutes later, mid-training): ~70 lines of TensorStore spec per array. The
    restore's own error already named the failure."""
    obj = unraisable.object
    return inspect.iscoroutine(obj) and "orbax" in obj.cr_code.co_filename


def _quiet_orbax_failures() -> None:
    """Installs the filters above once per process, so a failed save ends with one line, the caller's."""
    for name in ("absl", "asyncio"):
        logging.getLogger(name).addFilter(_ONE_LINE)
    # A failed save's write coroutines, never awaited, warn when collected, possibly at exit after the one line
    # ("coroutine ... was never awaited" and "Enable tracemalloc ..."): seen as the last line of a disk-full exit.
    # jaxlm runs no coroutines of its own, so these are Orbax's.
    warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)
    if getattr(sys.unraisablehook, "jaxlm_quiet", False):
        return
    atexit.register(_ONE_LINE.print_unreported)
    previous = sys.unraisablehook

    def hook(unraisable):
        if not (_closed_loop_callback(unraisable) or _abandoned_read(unraisable)):
            previous(unraisable)

    hook.jaxlm_quiet = True
    sys.unraisablehook = hook


# ----------------------------------------------------------------------------- the checkpointer


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True, primary: bool = True):
        """`primary`: the one process that tidies the directory (removes temporaries, moves corrupt steps)."""
        self.directory = Path(directory).absolute()
        self.primary = primary
        _quiet_orbax_failures()
        self.removed = self._remove_incomplete() if primary else []
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
        handlers = {
            name: ocp.StandardCheckpointHandler() if name == "state" else ocp.JsonCheckpointHandler() for name in ITEMS
        }
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)
        self.pending: int | None = None  # the step of an asynchronous save that may still be running

    def _remove_incomplete(self) -> list[str]:
        """Deletes the temporaries of saves that never finished (a killed process); returns their names."""
        if not self.directory.is_dir():
            return []
        leftovers = sorted(p for p in self.directory.iterdir() if TMP_MARKER in p.name)
        for path in leftovers:
            shutil.rmtree(path, ignore_errors=True)
        return [p.name for p in leftovers]

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    # ------------------------------------------------------------------------- saving

    def save(self, step: int, state, data_state: dict, config: dict) -> None:
        """Starts saving `step` (asynchronously unless async_save=False). Raises CheckpointSaveError if the state
        holds a non-finite value, or if this or an earlier asynchronous save failed (e.g. the disk is full)."""
        self.wait()  # Orbax would wait for the previous save anyway; this way its failure names its own step
        digest = integrity(state)
        bad = [path for path, d in digest.items() if d["nonfinite"]]
        if bad:
            kept = self.manager.latest_step()
            raise NonFiniteState(
                f"refusing to checkpoint step {step}: {len(bad)} leaves hold non-finite values (first: {bad[0]}); "
                + ("there is no earlier checkpoint" if kept is None else f"the last checkpoint, step {kept}, is kept")
            )
        try:
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    data=ocp.args.JsonSave({k: int(v) for k, v in data_state.items()}),
                    config=ocp.args.JsonSave(config),
                    integrity=ocp.args.JsonSave(digest),
                ),
            )
        except Exception as e:
            raise self._save_failed(step, e) from e
        self.pending = step

    def wait(self) -> None:
        """Blocks until pending saves are on disk; raises CheckpointSaveError if one failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:
            raise self._save_failed(self.pending, e) from e
        self.pending = None

    def _save_failed(self, step: int | None, error: Exception) -> CheckpointSaveError:
        self.pending = None
        gc.collect()  # orbax's abandoned write tasks report now, not after the caller's message
        if self.primary:
            self._remove_incomplete()  # a half-written step is useless and may fill the disk further
        self.manager.reload()
        kept = self.manager.latest_step()
        held = _ONE_LINE.held_back()
        orbax = f"; Orbax logged {len(held)} error line{'s' * (len(held) != 1)} about it" if held else ""
        return CheckpointSaveError(
            f"checkpoint save of step {step} failed ({_storage_cause(error)}); the last "
            f"complete checkpoint is {'step ' + str(kept) if kept is not None else 'none'} "
            f"in {self.directory}{orbax}",
            cause=_storage_cause(error),
        )

    # ------------------------------------------------------------------------- restoring

    def restore(self, step: int, abstract_state):
        """Returns (state, data_state, config_dict), verified against the saved integrity record if there is one
        (checkpoints written before it existed are restored unverified). `abstract_state` carries the target
        shardings. Raises CheckpointCorrupt if the step cannot be read or fails verification."""
        items = {
            "state": ocp.args.StandardRestore(abstract_state),
            "data": ocp.args.JsonRestore(),
            "config": ocp.args.JsonRestore(),
        }
        verified = (self.directory / str(step) / "integrity").exists()
        if verified:
            items["integrity"] = ocp.args.JsonRestore()
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:
            _ONE_LINE.held_back()  # Orbax's own lines about it: this error says what failed
            raise CheckpointCorrupt(_read_failure(e)) from e
        if verified:
            saved = dict(restored.integrity)
            for path, record in integrity(restored.state).items():
                # The checksum first: a flipped bit can also read back as NaN, and the mismatch is the cause.
                nonfinite = f" (it now holds {record['nonfinite']} non-finite values)" if record["nonfinite"] else ""
                if saved.get(path, {}).get("digest") != record["digest"]:
                    raise CheckpointCorrupt(f"{path} does not match its saved checksum{nonfinite}")
                if record["nonfinite"]:
                    raise CheckpointCorrupt(f"{path} holds {record['nonfinite']} non-finite values")
        return restored.state, dict(restored.data), dict(restored.config)

    def restore_config(self, step: int) -> dict:
        """Only the config saved with `step` (cheap: lets a caller check it before restoring arrays)."""
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
            return dict(restored.config)
        except Exception as e:
            _ONE_LINE.held_back()
            raise CheckpointCorrupt(f"its config cannot be read ({_one_line(e)})") from e

    def saved_shapes(self, step: int):
        """The saved state's tree of array metadata (shape, dtype), read without restoring the arrays."""
        return self.manager.item_metadata(step).state.tree

    def restore_latest(
        self, abstract_state, check: Callable[[int, dict], None] | None = None, log: Callable[[str], None] = print
    ) -> tuple[int, Any, dict, dict] | None:
        """(step, state, data_state, config) of the newest checkpoint that reads and verifies, or None if the
        directory holds none. `check(step, saved_config)` may raise to refuse a checkpoint written with an
        incompatible config (that is the user's error: it propagates, and nothing is moved).

        Corrupt checkpoints newer than the one restored are moved aside, one log line each. If none restores,
        nothing is moved and CheckpointCorrupt names every failure: that smells of a systemic problem (memory,
        a wrong mount) rather than of damage, and a run must never start over silently beside its checkpoints."""
        failures = []
        for step in reversed(self.all_steps()):
            try:
                saved_config = self.restore_config(step)
                if check is not None:
                    check(step, saved_config)
                restored = self.restore(step, abstract_state)
            except CheckpointCorrupt as e:
                failures.append((step, e))
                continue
            for bad, error in failures:
                log(
                    f"checkpoint step {bad} is unusable ({error}); moved it to {self.quarantine(bad)}; "
                    f"resuming from step {step}"
                )
            return (step, *restored)
        if failures:
            raise CheckpointCorrupt(
                f"no checkpoint in {self.directory} is usable: "
                + "; ".join(f"step {step}: {e}" for step, e in failures)
            )
        return None

    def quarantine(self, step: int) -> Path:
        """Moves step's directory to `<dir>.corrupt/` (kept for inspection, out of Orbax's sight)."""
        target_dir = self.directory.with_name(self.directory.name + ".corrupt")
        target = target_dir / str(step)
        if self.primary:
            target_dir.mkdir(exist_ok=True)
            n = 1
            while target.exists():
                target, n = target_dir / f"{step}.{n}", n + 1
            shutil.move(str(self.directory / str(step)), str(target))
        if jax.process_count() > 1:  # the others must not list the directory before the move is done
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"jaxlm_quarantine_{step}")
        self.manager.reload()
        return target

    def close(self) -> None:
        """Waits for pending saves, then closes; a failed save raises CheckpointSaveError (after closing)."""
        try:
            self.wait()
        finally:
            self.manager.close()


_OS_PROBLEM = re.compile(
    r"No space left on device|File too large|Disk quota exceeded|Read-only file system|"
    r"Permission denied|Input/output error"
)


def save_tree(directory: Path, tree) -> None:
    """Writes a pytree of arrays as one Orbax checkpoint at `directory`, synchronously (a quantized model's
    weights); CheckpointSaveError naming the storage problem (a full disk, say) in one line, Orbax's own lines
    held back."""
    _quiet_orbax_failures()
    checkpointer = ocp.StandardCheckpointer()
    try:
        checkpointer.save(Path(directory).absolute(), tree)
        checkpointer.wait_until_finished()
    except Exception as e:
        gc.collect()  # orbax's abandoned write tasks report now, held back with the rest
        _ONE_LINE.held_back()
        raise CheckpointSaveError(f"saving {directory} failed ({_storage_cause(e)})", cause=_storage_cause(e)) from e
    finally:
        checkpointer.close()


def _storage_cause(error: Exception) -> str:
    """The storage problem behind a failed save, short: Orbax wraps the OS error in long TensorStore text."""
    found = _OS_PROBLEM.search(str(error))
    return found.group(0) if found else _one_line(error, 160)


def _read_failure(error: Exception) -> str:
    """A failed read, short. Orbax wraps TensorStore's error (which array, what is wrong with its bytes) in one
    that names only slice indices and prints a spec; the wrapped one is the cause, and the file it names is the
    checkpoint's own, which the caller names already."""
    while error.__cause__ is not None:
        error = error.__cause__
    return _one_line(error, text=re.sub(r' in OCDBT database at local file "[^"]*"', "", str(error)))


def _one_line(error: Exception, limit: int = 240, text: str | None = None) -> str:
    text = (str(error) if text is None else text).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(error).__name__}: {line[:limit] + '...' if len(line) > limit else line}"
