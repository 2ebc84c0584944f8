"""The `dsv41_jax.model` package: its layout, its lazy names and the names of the module it replaces."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import dsv41_jax.model as model_pkg

MODULES = sorted(model_pkg._SUBMODULES)


def test_config_imports_no_flax():
    # the core's metadata builders import the config and layer types; the kernels' users need no Flax
    code = "import sys, dsv41_jax.model.config, dsv41_jax.model.layer_types; print('flax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("name", MODULES)
def test_every_module_declares_what_it_exports(name):
    mod = importlib.import_module(f"dsv41_jax.model.{name}")
    assert mod.__all__, name
    for attr in mod.__all__:
        assert hasattr(mod, attr), f"dsv41_jax.model.{name}.{attr}"


def test_names_of_the_former_model_module_resolve():
    # `dsv41_jax.model` was one module (the dense forward and the indexer rules); its names keep working
    from dsv41_jax.model import dense, indexer, nn, rope_tables

    homes = {dense: ["cache_roundtrip", "dense_forward", "decoder_tail"],
             indexer: ["index_query", "index_keys", "index_scores", "candidate_mask", "select_topk", "run_indexer"],
             rope_tables: ["RopeTables", "make_rope_tables"], nn: ["DeepseekV41Attention", "DeepseekV41Model"]}
    for mod, names in homes.items():
        for name in names:
            assert getattr(model_pkg, name) is getattr(mod, name), name
    assert set(model_pkg.__all__) <= {n for names in homes.values() for n in names}
    with pytest.raises(AttributeError):
        model_pkg.no_such_name  # noqa: B018


def test_the_modules_run_the_forward_pass():
    from dsv41_jax.model.nn import DecoderLayer, DeepseekV41Attention, DeepseekV41Model

    for cls in (DeepseekV41Attention, DecoderLayer, DeepseekV41Model):
        assert "__call__" in vars(cls), cls.__name__
