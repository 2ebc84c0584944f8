"""The alias finder of moved module paths (`dsv41_jax._moved`)."""

import importlib
import sys
import types

import pytest

from dsv41_jax import _moved


@pytest.fixture
def fake_move(monkeypatch):
    new = types.ModuleType("dsv41_jax._test_new_home")
    new.VALUE = 41
    monkeypatch.setitem(sys.modules, "dsv41_jax._test_new_home", new)
    monkeypatch.setitem(_moved.MOVED_MODULES, "dsv41_jax._test_old_path", "dsv41_jax._test_new_home")
    yield new
    sys.modules.pop("dsv41_jax._test_old_path", None)


def test_old_path_is_the_new_module(fake_move):
    old = importlib.import_module("dsv41_jax._test_old_path")
    assert old is fake_move
    from dsv41_jax._test_old_path import VALUE

    assert VALUE == 41


def test_every_listed_path_imports_its_new_home():
    for old, new in _moved.MOVED_MODULES.items():
        assert importlib.import_module(old) is importlib.import_module(new), old


def test_unlisted_path_is_not_answered():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("dsv41_jax._no_such_module")


def test_alias_keeps_the_modules_own_spec():
    import dsv41_jax.backends as old
    import dsv41_jax.sparse_mla.capabilities as new

    assert old is new and new.__spec__.name == "dsv41_jax.sparse_mla.capabilities"
