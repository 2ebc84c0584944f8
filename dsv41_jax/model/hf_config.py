"""Where a Hugging Face config comes from, and which of its keys a reader used.

`resolve_hf_config(source)` turns any accepted source into one flat mapping of the model's fields:

- a mapping in the flat form (`{"hidden_size": ..., "num_hidden_layers": ...}`);
- a mapping in the composite form Hugging Face uses for models with several sub-configs, the text
  model's fields under `text_config` (`{"architectures": [...], "text_config": {...}, ...}`): the fields
  are read from `text_config` only, and every other top-level key is ignored;
- a path (`str` or `os.PathLike`) to a `config.json`, or to a directory holding one;
- an object with a `to_dict()` method returning either form (a `transformers.PretrainedConfig`).

`KeyRecorder` wraps the flat mapping and records every key a reader looks at, so that the reader can
report the keys it used and those it ignored (`HFConfigKeys`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["HFConfigKeys", "KeyRecorder", "resolve_hf_config", "TEXT_CONFIG"]

TEXT_CONFIG = "text_config"


@dataclasses.dataclass(frozen=True)
class HFConfigKeys:
    """The keys of a config source that a reader used and ignored.

    Keys of the composite form's `text_config` are named `text_config.<key>`; `source` is the path
    read, or the type of the object given.
    """

    used: tuple[str, ...]
    ignored: tuple[str, ...]
    composite: bool
    source: str


class KeyRecorder(Mapping):
    """A read-only view of a mapping that records each key looked up (by `[]`, `get` or `in`)."""

    def __init__(self, data: Mapping[str, Any]):
        self._data = data
        self._read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self._read.add(key)
        return self._data[key]

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self._read.add(key)
        return key in self._data

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    @property
    def used(self) -> tuple[str, ...]:
        """Keys present in the mapping that were looked up, sorted."""
        return tuple(sorted(k for k in self._data if k in self._read))

    @property
    def ignored(self) -> tuple[str, ...]:
        """Keys present in the mapping that were never looked up, sorted."""
        return tuple(sorted(k for k in self._data if k not in self._read))


def _read_json(path: str) -> Mapping[str, Any]:
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"config path {path!r} does not exist (expected a config.json or a directory holding one)")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {path!r} is not valid JSON: {e}") from None
    if not isinstance(data, Mapping):
        raise TypeError(f"config file {path!r} must hold a JSON object, got {type(data).__name__}")
    return data


def resolve_hf_config(source: Any) -> tuple[Mapping[str, Any], tuple[str, ...], bool, str]:
    """`(fields, ignored_top_level_keys, composite, source_name)` of a config source (see the module doc).

    Raises TypeError for a source of another kind and ValueError for a path that does not hold a config.
    """
    name = type(source).__name__
    if isinstance(source, (str, os.PathLike)):
        name = os.fspath(source)
        data = _read_json(name)
    elif isinstance(source, Mapping):
        data = source
    elif callable(getattr(source, "to_dict", None)):
        data = source.to_dict()
        if not isinstance(data, Mapping):
            raise TypeError(f"config object {name}.to_dict() must return a mapping, got {type(data).__name__}")
    else:
        raise TypeError(f"config must be a mapping, a path to a config.json or an object with to_dict() "
                        f"(a transformers config), got {name}")
    if TEXT_CONFIG not in data:
        return data, (), False, name
    text = data[TEXT_CONFIG]
    if not isinstance(text, Mapping) and callable(getattr(text, "to_dict", None)):
        text = text.to_dict()
    if not isinstance(text, Mapping):
        raise TypeError(f"config key {TEXT_CONFIG!r} must be a mapping of the text model's fields, "
                        f"got {type(text).__name__}")
    return text, tuple(sorted(k for k in data if k != TEXT_CONFIG)), True, name
