"""The public surface: `__all__` of the package and its public modules, the old module paths, the import graph."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import dsv41_jax as d

ROOT = Path(__file__).resolve().parent.parent

PUBLIC_MODULES = [
    "dsv41_jax.buckets", "dsv41_jax.device", "dsv41_jax.info", "dsv41_jax.kv_cache", "dsv41_jax.metadata",
    "dsv41_jax.plans", "dsv41_jax.rope", "dsv41_jax.scheduler", "dsv41_jax.sharding", "dsv41_jax.sparse_mla",
    "dsv41_jax.sparse_mla.api", "dsv41_jax.sparse_mla.base", "dsv41_jax.sparse_mla.capabilities",
    "dsv41_jax.sparse_mla.implementations", "dsv41_jax.sparse_mla.reference",
]

# What the old modules exported (their `__all__`), minus the upward registration functions the
# implementation table replaces (register_decode_impl, register_prefill_impl, register_impl_availability).
OLD_EXPORTS = {
    "dsv41_jax.attention": ["DecodeCall", "PrefillCall", "ImplCandidate", "ImplChoice", "AUTO_ORDER", "explain_impl",
                            "sparse_mla_decode", "sparse_mla_prefill", "sparse_mla_mega_decode",
                            "sparse_mla_mega_prefill", "decode_impls", "prefill_impls", "quantize_output_fp8"],
    "dsv41_jax.backends": ["DeviceInfo", "BackendSpec", "BackendSelectionError", "FLASHMLA_SPARSE_DSV41",
                           "FLASHMLA_MEGA_ATTN_DSV41", "CUDA_SPARSE_DSV41", "PALLAS_SPARSE_DSV41", "XLA_SPARSE_DSV41",
                           "KV_CACHE_FORMATS", "canonical_kv_cache_dtype", "register_backend", "registered_backends",
                           "get_backend", "select_backend"],
    "dsv41_jax.reference": ["Pool", "sparse_attention_rows"],
    "dsv41_jax.kv_cache": ["FORMATS", "LATENT_DIM"],
    "dsv41_jax.scheduler": ["default_num_sms", "DEFAULT_NUM_SMS"],
}


def test_every_name_in_the_package_all_resolves():
    assert len(d.__all__) == len(set(d.__all__)) >= 78
    missing = [n for n in d.__all__ if getattr(d, n, None) is None]
    assert not missing, missing


def test_every_public_name_of_the_package_is_in_all():
    names = {n for n in vars(d) if not n.startswith("_")}
    assert names <= set(d.__all__), sorted(names - set(d.__all__))


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_modules_declare_all(module):
    mod = importlib.import_module(module)
    assert isinstance(mod.__all__, list) and mod.__all__, module
    assert not [n for n in mod.__all__ if not hasattr(mod, n)]


@pytest.mark.parametrize("module", sorted(OLD_EXPORTS))
def test_old_names_keep_working_from_the_old_path(module):
    mod = importlib.import_module(module)
    assert not [n for n in OLD_EXPORTS[module] if not hasattr(mod, n)]


def test_one_definition_of_the_shared_constants():
    from dsv41_jax import kv_cache
    from dsv41_jax.sparse_mla import capabilities

    assert d.LATENT_DIM == kv_cache.LATENT_DIM == 512
    assert kv_cache.FORMATS is kv_cache.KV_FORMATS is kv_cache.KV_CACHE_FORMATS is capabilities.KV_CACHE_FORMATS
    assert capabilities.canonical_kv_cache_dtype is kv_cache.canonical_kv_cache_dtype
    assert capabilities.DeviceInfo is d.device.DeviceInfo is d.DeviceInfo
    assert d.scheduler.default_num_sms is d.device.default_num_sms


def test_the_core_imports_no_backend_until_an_implementation_is_asked_for():
    code = ("import sys, dsv41_jax as d; "
            "assert not {'cuda_ffi', 'pallas_kernels'} & set(sys.modules), sorted(sys.modules); "
            "d.explain_impl; d.select_backend(platform='cpu', require_available=False); "
            "assert not {'cuda_ffi', 'pallas_kernels'} & set(sys.modules); "
            "d.sparse_mla.decode_impls(); assert {'cuda_ffi', 'pallas_kernels'} <= set(sys.modules); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_backends_do_not_import_the_dispatch():
    for pkg in ("cuda_ffi/__init__.py", "pallas_kernels/__init__.py"):
        text = (ROOT / pkg).read_text()
        for name in ("register_decode_impl", "register_prefill_impl", "register_impl_availability",
                     "dsv41_jax.sparse_mla.api", "dsv41_jax.attention"):
            assert name not in text, (pkg, name)
