"""Runs a user's Python file (a run config, a mesh layout) and turns whatever it raises into one line.

A leaf module: configs (`jaxlm.config`) and layouts (`sharding.mesh`) both load user files through it, so neither
imports the other to do so.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import re
import traceback
import types
from pathlib import Path


def exec_python_file(path: Path, kind: str, error: type[Exception] = ValueError) -> types.ModuleType:
    """Runs a user's Python file; a file of another kind, a syntax error or anything the file raises becomes one
    line of `error` naming the file (and the line of it that raised)."""
    path = Path(path)
    if path.suffix != ".py":
        raise error(f"{kind} file {path} must be a Python file (.py)")
    spec = importlib.util.spec_from_file_location(f"_jaxlm_{kind.replace(' ', '_')}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise error(f"{kind} file {path}: syntax error at line {e.lineno}: {e.msg}") from None
    except Exception as e:  # a user's file may raise anything
        raise error(_user_code_error(e, path, kind, vars(module))) from None
    return module


def call_user_function(fn, *args, path: Path, kind: str, error: type[Exception] = ValueError):
    """Calls a function from a user's file (`def config()`, `def layout(num_devices)`); fails as exec_python_file."""
    try:
        return fn(*args)
    except Exception as e:
        raise error(_user_code_error(e, path, kind, getattr(fn, "__globals__", {}))) from None


def _user_code_error(e: Exception, path: Path, kind: str, namespace: dict) -> str:
    """One line for an exception from a user's file: the line of the file that raised it, and a misspelt
    keyword of a dataclass in the file's namespace (ModelConfig, MeshLayout, ...) by name."""
    source = namespace.get("__file__")  # the name its code was compiled under (absolute, unlike `path`)
    lines = [frame.lineno for frame in traceback.extract_tb(e.__traceback__) if frame.filename == source]
    where = f"{kind} file {path}" + (f", line {lines[-1]}" if lines else "")
    kwarg = re.fullmatch(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'", str(e))
    cls = namespace.get(kwarg[1]) if isinstance(e, TypeError) and kwarg else None
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return f"{where} raised {type(e).__name__}: {e}"
    names = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(kwarg[2], names, n=1)
    hint = f"did you mean {close[0]!r}?" if close else f"fields: {', '.join(names)}"
    return f"{where}: {cls.__name__} has no field {kwarg[2]!r} ({hint})"
