"""Safetensors checkpoints on disk: one file, a directory, or shards behind `model.safetensors.index.json`.

`open_checkpoint(path)` lists where every tensor of a checkpoint is (file, shape, dtype) without reading
any data. `path` may be:

- a `.safetensors` file;
- an index json (`{"weight_map": {tensor name: shard file name}}`, shards next to it), as Hugging Face
  writes for sharded checkpoints;
- a directory: its `model.safetensors.index.json` when there is one, else every `*.safetensors` in it;
- a list of `.safetensors` files.

The index is trusted for where each tensor is and checked against the shards: a shard it names that does
not exist, a tensor it maps to a shard that does not hold it, or a tensor a shard holds that it does not
list is a `ValueError` naming the tensors and the files. Without an index a tensor held by two files is an
error too.

`write_checkpoint(tensors, path, max_shard_size=...)` writes the same layouts as Hugging Face's
`save_pretrained`: one file, or shards `model-0000i-of-0000n.safetensors` with the index.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from collections.abc import Iterable, Mapping

import numpy as np

__all__ = ["INDEX_NAME", "WEIGHTS_NAME", "TensorInfo", "Checkpoint", "open_checkpoint", "write_checkpoint",
           "parse_size"]

INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "model.safetensors"


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor of a checkpoint is and what it is (no data)."""

    file: str
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The files of a checkpoint, its index (if any) and each tensor's `TensorInfo` by name."""

    files: tuple[str, ...]
    index: str | None
    tensors: Mapping[str, TensorInfo]

    def describe(self) -> str:
        """Where tensors were looked for, for error messages."""
        if self.index is not None:
            return f"the weight_map of {self.index}"
        return "file " + self.files[0] if len(self.files) == 1 else "files " + ", ".join(self.files)


def _list_file(path: str) -> dict[str, TensorInfo]:
    from safetensors import safe_open

    out = {}
    with safe_open(path, framework="numpy") as fh:
        for k in fh.keys():
            sl = fh.get_slice(k)
            out[k] = TensorInfo(path, tuple(int(n) for n in sl.get_shape()), str(sl.get_dtype()))
    return out


def _join_names(names: Iterable[str], limit: int = 20) -> str:
    names = sorted(names)
    return ", ".join(names[:limit]) + (f" ... ({len(names) - limit} more)" if len(names) > limit else "")


def _from_index(index: str) -> Checkpoint:
    try:
        with open(index) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"checkpoint index {index!r} is not valid JSON: {e}") from None
    wmap = data.get("weight_map") if isinstance(data, Mapping) else None
    if not isinstance(wmap, Mapping) or not all(isinstance(v, str) for v in wmap.values()):
        raise ValueError(f"checkpoint index {index!r} must hold a 'weight_map' of tensor name -> shard file name")
    root = os.path.dirname(index)
    shards: dict[str, list[str]] = {}
    for name, shard in wmap.items():
        shards.setdefault(os.path.join(root, shard), []).append(name)
    absent = [f for f in shards if not os.path.isfile(f)]
    if absent:
        listed = "; ".join(f"{f} (for {len(shards[f])} tensors: {_join_names(shards[f], 3)})" for f in absent)
        raise ValueError(f"checkpoint index {index!r} names shards that do not exist: {listed}")
    tensors: dict[str, TensorInfo] = {}
    problems = []
    for f, names in shards.items():
        held = _list_file(f)
        lost = set(names) - set(held)
        if lost:
            problems.append(f"{f} does not hold {len(lost)} tensors the index maps to it: {_join_names(lost)}")
        stray = set(held) - set(wmap)
        if stray:
            problems.append(f"{f} holds {len(stray)} tensors the index does not list: {_join_names(stray)}")
        tensors.update({n: held[n] for n in names if n in held})
    if problems:
        raise ValueError(f"checkpoint index {index!r} and its shards disagree:\n  " + "\n  ".join(problems))
    return Checkpoint(tuple(sorted(shards)), index, tensors)


def _from_files(files: list[str]) -> Checkpoint:
    tensors: dict[str, TensorInfo] = {}
    twice = []
    for f in files:
        if not os.path.isfile(f):
            raise ValueError(f"weights file {f!r} does not exist")
        for name, info in _list_file(f).items():
            if name in tensors:
                twice.append(f"{name} (in {tensors[name].file} and {f})")
            tensors[name] = info
    if twice:
        raise ValueError(f"tensors held by more than one file and no {INDEX_NAME} to choose: " + "; ".join(twice[:20]))
    return Checkpoint(tuple(files), None, tensors)


def open_checkpoint(path: str | os.PathLike | Iterable[str | os.PathLike]) -> Checkpoint:
    """Every tensor of the checkpoint at `path` (see the module doc); reads headers only."""
    if not isinstance(path, (str, os.PathLike)):
        files = [os.fspath(p) for p in path]
        if not files:
            raise ValueError("path must name at least one .safetensors file, got an empty list")
        return _from_files(files)
    path = os.fspath(path)
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_NAME)
        if os.path.isfile(index):
            return _from_index(index)
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise ValueError(f"no {INDEX_NAME} and no *.safetensors file in directory {path!r}")
        return _from_files(files)
    if not os.path.exists(path):
        raise ValueError(f"weights file {path!r} does not exist")
    if path.endswith(".json"):
        return _from_index(path)
    return _from_files([path])


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes of `size`: an int, or a string like "5GB" (decimal units, as Hugging Face) or "512MiB"."""
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    elif isinstance(size, str) and (m := re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", size)) \
            and m.group(2).lower() in _UNITS:
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"max_shard_size must be a positive int of bytes or a size like '5GB', got {size!r}")
    if n <= 0:
        raise ValueError(f"max_shard_size must be > 0 bytes, got {size!r}")
    return n


def write_checkpoint(tensors: Mapping[str, np.ndarray], path: str | os.PathLike, *,
                     max_shard_size: int | str | None = None) -> list[str]:
    """Write `tensors`; returns the files written.

    Without `max_shard_size`: one file at `path` (or `path/model.safetensors` when `path` is a directory).
    With it: `path` is a directory (created); tensors go in name order into shards of at most
    `max_shard_size` bytes (a larger tensor gets a shard of its own), named
    `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`; when one shard holds everything
    it is `model.safetensors` and no index is written, as `save_pretrained` does.
    """
    from safetensors.numpy import save_file

    meta = {"format": "pt"}  # what transformers expects of a safetensors file it loads
    path = os.fspath(path)
    if max_shard_size is None:
        target = os.path.join(path, WEIGHTS_NAME) if os.path.isdir(path) else path
        save_file(dict(tensors), target, metadata=meta)
        return [target]
    limit = parse_size(max_shard_size)
    os.makedirs(path, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        n = tensors[name].nbytes
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += n
    if len(shards) == 1:
        target = os.path.join(path, WEIGHTS_NAME)
        save_file(shards[0], target, metadata=meta)
        return [target]
    written, wmap = [], {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata=meta)
        written.append(os.path.join(path, fname))
        wmap.update({k: fname for k in shard})
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))}, "weight_map": wmap}
    with open(os.path.join(path, INDEX_NAME), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    written.append(os.path.join(path, INDEX_NAME))
    return written
