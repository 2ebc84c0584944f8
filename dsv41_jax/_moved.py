"""Module paths that moved: each old path is an alias of the module that holds its code now.

`import dsv41_jax.attention` (an old path) returns the very module object of its new home, so names,
`isinstance` checks and monkeypatching behave as with the new path. The finder only answers for the
paths listed here and imports nothing until one of them is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["MOVED_MODULES", "install"]

# old module path -> the module that holds it now
MOVED_MODULES: dict[str, str] = {
    "dsv41_jax.attention": "dsv41_jax.sparse_mla.api",
    "dsv41_jax.backends": "dsv41_jax.sparse_mla.capabilities",
    "dsv41_jax.reference": "dsv41_jax.sparse_mla.reference",
    # the model side lives in the `dsv41_jax.model` package
    "dsv41_jax.checkpoint": "dsv41_jax.model.checkpoint",
    "dsv41_jax.config": "dsv41_jax.model.config",
    "dsv41_jax.engine": "dsv41_jax.model.engine",
    "dsv41_jax.engine_stats": "dsv41_jax.model.engine_stats",
    "dsv41_jax.envelope": "dsv41_jax.model.envelope",
    "dsv41_jax.hf_config": "dsv41_jax.model.hf_config",
    "dsv41_jax.layer_types": "dsv41_jax.model.layer_types",
    "dsv41_jax.nn": "dsv41_jax.model.nn",
    "dsv41_jax.weights": "dsv41_jax.model.weights",
}


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(MOVED_MODULES[spec.name])
        # The import system sets `__spec__` of what this returns to the alias's spec; `exec_module`
        # puts the module's own spec back, so `__spec__.name` stays its real path.
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """The new module has run already (`create_module` imported it); restore its own spec."""
        alias = module.__spec__.name
        if alias in self._own_specs:
            module.__spec__ = self._own_specs.pop(alias)

    def __init__(self) -> None:
        self._own_specs: dict[str, importlib.machinery.ModuleSpec] = {}


_FINDER = _AliasFinder()


def install() -> None:
    """Put the alias finder on `sys.meta_path` (once)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
