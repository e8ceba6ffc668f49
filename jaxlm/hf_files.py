"""The files of a Hugging Face model directory: safetensors (sharded above a size, with an index), config.json,
generation_config.json and the tokenizer files, written so `AutoModelForCausalLM` / `AutoTokenizer.from_pretrained`
load them with nothing else, and read back lazily, one tensor at a time.

Shards are written as their tensors arrive, so a writer holds at most one shard (`max_shard_bytes`) plus the
tensor being added; file names follow transformers' `model-0000i-of-0000n.safetensors`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable

import numpy as np

from data.atomic_dir import rust_os_error
from data.fault_points import pause_point
from data.ownership import Kind, OwnershipError, check_target
from jaxlm.hf import HFError

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = ("float32", "bfloat16")


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise HFError(f"{path} does not exist") from None
    except (OSError, ValueError) as e:
        raise HFError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise HFError(f"{path} must hold a JSON object")
    return data


def write_safetensors(
    directory: Path, tensors: Iterable[tuple[str, np.ndarray]], *, dtype: str, max_shard_bytes: int
) -> list[str]:
    """Writes (name, float32 array) pairs as `dtype`, in shards of at most `max_shard_bytes` (a larger tensor gets
    a shard of its own) with an index when there are several; returns the file names."""
    from safetensors.numpy import save_file

    target = _np_dtype(dtype)
    written: list[tuple[str, list[str], int]] = []  # (temporary name, tensor names, bytes) per shard
    shard: dict[str, np.ndarray] = {}

    def flush():
        name = f"shard-{len(written):05d}.tmp"
        try:
            save_file(shard, str(directory / name), metadata={"format": "pt"})
        except Exception as e:  # safetensors' own error type for I/O: an OSError again, so a full disk reads as one
            os_error = rust_os_error(e, directory / name)
            if os_error is None:
                raise
            raise os_error from None
        written.append((name, list(shard), sum(a.nbytes for a in shard.values())))
        shard.clear()
        pause_point("export.shard")

    for name, array in tensors:
        array = np.ascontiguousarray(np.asarray(array, np.float32).astype(target))
        if shard and sum(a.nbytes for a in shard.values()) + array.nbytes > max_shard_bytes:
            flush()
        shard[name] = array
    if shard or not written:
        flush()
    if len(written) == 1:
        os.replace(directory / written[0][0], directory / SINGLE)
        return [SINGLE]
    n, weight_map, names = len(written), {}, []
    for i, (tmp, tensor_names, _) in enumerate(written):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(directory / tmp, directory / final)
        weight_map |= dict.fromkeys(tensor_names, final)
        names.append(final)
    total = sum(nbytes for *_, nbytes in written)
    write_json(directory / INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return names


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.float32


class TensorReader:
    """The tensors of an HF directory (one safetensors file, or shards named by an index), read one at a time as
    float32 and checked against the shape the caller expects."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._open: dict[str, object] = {}  # file name -> safe_open handle
        index = directory / INDEX
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise HFError(f"{index} has no weight_map")
            self.files = dict(weight_map)
        elif (directory / SINGLE).is_file():
            self.files = dict.fromkeys(self._keys(SINGLE), SINGLE)
        else:
            raise HFError(f"{directory} holds no {SINGLE} or {INDEX}")

    def _keys(self, file: str) -> list[str]:
        return list(self._handle(file).keys())

    def _handle(self, file: str):
        if file not in self._open:
            from safetensors import safe_open

            path = self.directory / file
            try:
                self._open[file] = safe_open(str(path), framework="numpy")
            except Exception as e:  # the Rust library raises its own error types
                raise HFError(f"{path} cannot be read as safetensors: {str(e).splitlines()[0]}") from None
        return self._open[file]

    @property
    def names(self) -> list[str]:
        return list(self.files)

    def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """The tensor as float32; HFError naming it if it is missing, mis-shaped or not a float."""
        if name not in self.files:
            raise HFError(f"tensor {name} is missing from {self.directory}")
        handle = self._handle(self.files[name])
        if name not in handle.keys():
            raise HFError(f"tensor {name} is missing from {self.directory / self.files[name]} (named by {INDEX})")
        array = handle.get_tensor(name)
        if tuple(array.shape) != tuple(shape):
            raise HFError(f"tensor {name} has shape {list(array.shape)}, expected {list(shape)} from config.json")
        if array.dtype.kind != "f" and str(array.dtype) != "bfloat16":
            raise HFError(f"tensor {name} has dtype {array.dtype}, expected a float")
        return array.astype(np.float32)


def write_tokenizer(directory: Path, tokenizer, *, max_length: int) -> None:
    """tokenizer.json (the `tokenizers` library's own file) and a tokenizer_config.json naming its special tokens,
    which is all `AutoTokenizer` needs."""
    tokenizer.save(directory)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": tokenizer.eos_token,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.bos_token is not None:
        config["bos_token"] = tokenizer.bos_token
    write_json(directory / TOKENIZER_CONFIG, config)


def generation_config(eos_id: int, bos_id: int | None) -> dict:
    config = {"eos_token_id": eos_id, "pad_token_id": eos_id}
    return config if bos_id is None else {"bos_token_id": bos_id, **config}


def check_new_dir(path: Path, flag: str, kind: Kind) -> None:
    """An output directory (`flag` names it) holding `kind` must be new or empty, outside any other command's
    directory, and its parent writable: an import or export writes beside it and renames into place, and never
    overwrites anything."""
    try:
        check_target(path, kind, flag)
    except OwnershipError as e:
        raise HFError(str(e)) from None
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        raise HFError(f"{flag} {path} exists and is not an empty directory")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise HFError(f"{flag} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):
        raise HFError(f"{flag} {path}: {parent} is not writable")
