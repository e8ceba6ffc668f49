"""Which command a directory belongs to, so that no command writes into another's.

A training run that started in an HF export replaced its config.json; one started in a token dataset replaced the
dataset's tokenizer.json; an export written inside a run's checkpoints/ was deleted by checkpoint rotation. Every
writer asks `check_target` first. A directory is recognised by its own files: a training workdir by the marker
training writes into it (or, written before the marker existed, by a jaxlm config.json), a token dataset by its
manifest, an HF model by a config.json with a `model_type`, a quantized checkpoint by its manifest.

Nesting: nothing is written inside a dataset, an HF model or a quantized checkpoint. A training workdir keeps
`checkpoints/` and its own files to itself, but other outputs may live in it (`WORKDIR/hf`, the default
`WORKDIR/quantized_int8`, a DiLoCo replica's `WORKDIR/replica_0`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path

from data.atomic_file import write_atomic

WORKDIR_MARKER = ".jaxlm-workdir"
WORKDIR_FORMAT = "jaxlm-workdir"
# What a training run writes at its workdir's top level: nothing else may take these names.
WORKDIR_OWN = frozenset(
    {WORKDIR_MARKER, "checkpoints", "config.json", "tokenizer.json", "metrics.jsonl", "goodput.jsonl", "run.lock"}
    | {"tensorboard", "loss.png"}
)


class OwnershipError(ValueError):
    """A target inside, or equal to, a directory of another kind; the message names both."""


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str  # "a training workdir"
    written_by: str  # the command that writes one
    open_inside: bool = False  # whether other outputs may live inside it (outside its own names)
    use: str = ""  # how one is used, {path} standing for it: the advice when it is given where it does not belong

    def __str__(self) -> str:
        return self.name


WORKDIR = Kind("a training workdir", "training, e.g. python -m experiments.tiny_lm --workdir DIR", open_inside=True)
DATASET = Kind("a token dataset", "python -m data.prepare", use="train on it with --set data.path={path}")
HF_MODEL = Kind(
    "a Hugging Face model",
    "python -m experiments.export_hf, or transformers' save_pretrained",
    use="import it with python -m experiments.import_hf --hf {path} --workdir NEW_DIR",
)
QUANTIZED = Kind(
    "a quantized checkpoint",
    "python -m experiments.quantize_checkpoint",
    use="generate from it with python -m experiments.generate --workdir {path}",
)

_DATASET_FORMATS = ("jaxlm-token-shards", "jaxlm-tokens", "jaxlm-shards")  # data.token_shards / token_file / sources


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def is_jaxlm_config(path: Path) -> bool:
    """Whether `path` is a jaxlm run's config.json (sections `model` and `data`)."""
    saved = _json(path)
    return isinstance(saved, dict) and isinstance(saved.get("model"), dict) and isinstance(saved.get("data"), dict)


def kind_of(directory: Path) -> Kind | None:
    """The kind of directory `directory` is, or None for a plain one (or one that does not exist)."""
    d = Path(directory)
    if not d.is_dir():
        return None
    if (d / WORKDIR_MARKER).is_file() or is_jaxlm_config(d / "config.json"):
        return WORKDIR
    for marker in ("manifest.json", "meta.json"):
        found = _json(d / marker)
        if isinstance(found, dict) and found.get("format") in _DATASET_FORMATS:
            return DATASET
    manifest = _json(d / "manifest.json")
    if isinstance(manifest, dict) and "quantized_tensors" in manifest:
        return QUANTIZED
    hf_config = _json(d / "config.json")
    if isinstance(hf_config, dict) and ("model_type" in hf_config or "architectures" in hf_config):
        return HF_MODEL
    return None


def enclosing(path: Path) -> tuple[Path, Kind, Path] | None:
    """The nearest directory strictly above `path` that belongs to a command, as (that directory, its kind, the
    first component of `path` below it), or None."""
    path = Path(os.path.abspath(path))
    child = path
    for parent in path.parents:
        kind = kind_of(parent)
        if kind is not None:
            return parent, kind, child
        child = parent
    return None


def check_target(target: Path, writes: Kind | str, flag: str) -> None:
    """Raises OwnershipError when `flag`'s `target` (a directory or file a command is about to write, holding
    `writes`) lies inside another command's directory, or is one of another kind.

    Inside a training workdir only `checkpoints/` and the run's own files are refused. Whether an existing plain
    directory may be written is the caller's rule (training refuses one that is not empty)."""
    target = Path(target)
    what = str(writes)
    found = enclosing(target)
    if found is not None:
        root, kind, below = found
        if not kind.open_inside or below.name in WORKDIR_OWN:
            where = (
                f"is {root}'s own {below.name}, part of {kind}"
                if kind.open_inside and below == Path(os.path.abspath(target))
                else f"is inside {root / below.name if kind.open_inside else root}, which belongs to {kind}"
            )
            raise OwnershipError(
                f"{flag} {target} {where} ({kind.written_by}); writing {what} there could destroy it: give a "
                f"path outside it"
            )
    kind = kind_of(target)
    if kind is not None and kind != writes:
        use = f" ({kind.use.format(path=target)})" if kind.use else ""
        raise OwnershipError(
            f"{flag} {target} is {kind} ({kind.written_by}), not {what}; give a new or empty directory{use}"
        )


def claim_workdir(workdir: Path, flag: str = "--workdir") -> None:
    """Checks that a training run may write `workdir`: new, empty, or already a training workdir (one written
    before the marker existed counts: a jaxlm config.json). Writes nothing."""
    workdir = Path(workdir)
    check_target(workdir, WORKDIR, flag)
    if workdir.is_dir() and kind_of(workdir) is None:
        others = sorted(p.name for p in workdir.iterdir() if not p.name.startswith(("run.lock", ".run.lock")))
        if others:
            shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
            raise OwnershipError(
                f"{flag} {workdir} is not empty ({shown}) and is not a training workdir; training would write "
                f"its config.json, tokenizer.json and checkpoints/ among these files: give a new or empty directory"
            )


def mark_workdir(workdir: Path) -> None:
    """Marks `workdir` as a training workdir (once; a workdir written before the marker gains it on resume)."""
    marker = Path(workdir) / WORKDIR_MARKER
    if marker.is_file():
        return
    created = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    write_atomic(marker, json.dumps({"format": WORKDIR_FORMAT, "version": 1, "created": created}) + "\n")
