"""The CUDA library's first-use build: where it goes, when it runs, what it says when it cannot.

A GPU default device is simulated by `cuda_ffi._device_reason` answering None; cuda_ffi's loaded-library
state is reset per test, so nothing leaks into other tests.
The real build (nvcc + cmake, sm_90a only) runs where both tools are found and is skipped otherwise.
"""

from __future__ import annotations

import json
import logging

import pytest

import cuda_ffi
from cuda_ffi import build as cbuild
from dsv41_jax.sparse_mla import implementations


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No library anywhere cuda_ffi looks, a cache in tmp_path, a simulated GPU."""
    monkeypatch.delenv("DSV41_CUDA_LIB", raising=False)
    monkeypatch.delenv("DSV41_CUDA_AUTOBUILD", raising=False)
    monkeypatch.setenv("DSV41_CUDA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cuda_ffi, "_DEFAULT_LIB", tmp_path / "lib" / cbuild.LIB_NAME)
    for name, value in (("_lib", None), ("_load_error", None), ("_registered", False), ("_build_error", None),
                        ("_WARNED", set())):
        monkeypatch.setattr(cuda_ffi, name, value)
    monkeypatch.setattr(cuda_ffi, "_device_reason", lambda: None)
    return tmp_path


def test_cache_location_and_key(fresh, monkeypatch):
    root = fresh / "cache"
    assert cbuild.cache_root() == root
    key = cbuild.source_key("90a;100a")
    assert len(key) == 16 and int(key, 16) >= 0 and key != cbuild.source_key("90a")
    assert cbuild.cached_library_path() == root / key / cbuild.LIB_NAME
    assert cbuild.cached_library_path("90a") == root / cbuild.source_key("90a") / cbuild.LIB_NAME
    monkeypatch.delenv("DSV41_CUDA_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(fresh / "xdg"))
    assert cbuild.cache_root() == fresh / "xdg" / "dsv41_jax" / "cuda"


def test_library_path_order(fresh, monkeypatch):
    cached = cbuild.cached_library_path()
    assert cuda_ffi.library_path() == cached and not cuda_ffi.library_present()
    cuda_ffi._DEFAULT_LIB.parent.mkdir()
    cuda_ffi._DEFAULT_LIB.write_bytes(b"")  # the explicit build wins over the cache
    assert cuda_ffi.library_path() == cuda_ffi._DEFAULT_LIB
    monkeypatch.setenv("DSV41_CUDA_LIB", str(fresh / "mine.so"))  # and $DSV41_CUDA_LIB over both
    assert cuda_ffi.library_path() == fresh / "mine.so"
    assert "DSV41_CUDA_LIB" in cuda_ffi.backend_unavailable_reason()


def test_no_nvcc_on_a_gpu_is_said_not_silent(fresh, monkeypatch, caplog):
    monkeypatch.setattr(cbuild, "find_nvcc", lambda: None)
    monkeypatch.setattr(cbuild, "build_cached", lambda **kw: pytest.fail("must not build without nvcc"))
    caplog.set_level(logging.WARNING, logger="dsv41_jax")
    why = cuda_ffi.backend_unavailable_reason()
    assert "not built" in why and "nvcc not found" in why and "install the CUDA toolkit" in why
    assert implementations.unavailable_reason("cuda") == why  # what select_backend, and so impl="auto", hears
    # logged once, even when another kernel then runs
    assert [r.getMessage() for r in caplog.records if r.name.startswith("dsv41_jax")] == [why]


def test_the_first_use_build_can_be_turned_off(fresh, monkeypatch):
    monkeypatch.setenv("DSV41_CUDA_AUTOBUILD", "0")
    monkeypatch.setattr(cbuild, "build_cached", lambda **kw: pytest.fail("the first-use build is off"))
    why = cuda_ffi.backend_unavailable_reason()
    assert "first-use build off: DSV41_CUDA_AUTOBUILD=0" in why and "python -m cuda_ffi.build" in why


def test_a_failed_build_is_reported_once_and_not_retried(fresh, monkeypatch, caplog):
    if cbuild.missing_tools():
        monkeypatch.setattr(cbuild, "missing_tools", lambda: [])
    calls = []

    def failing(**kw):
        calls.append(kw)
        raise cbuild.BuildError("nvcc exploded (test)")

    monkeypatch.setattr(cbuild, "build_cached", failing)
    caplog.set_level(logging.WARNING, logger="dsv41_jax")
    why = cuda_ffi.backend_unavailable_reason()
    assert "first-use build" in why and "failed" in why and "nvcc exploded (test)" in why
    assert cuda_ffi.backend_unavailable_reason() == why and len(calls) == 1
    assert any("nvcc exploded (test)" in r.getMessage() for r in caplog.records if r.name.startswith("dsv41_jax"))
    assert cuda_ffi.backend_unavailable_reason(build_missing=False) != why  # info's question builds nothing


def test_info_asks_without_building(fresh, monkeypatch):
    monkeypatch.setattr(cbuild, "build_cached", lambda **kw: pytest.fail("info must not build"))
    why = cuda_ffi.backend_unavailable_reason(build_missing=False)
    assert "not built" in why


@pytest.mark.slow
@pytest.mark.skipif(bool(cbuild.missing_tools()), reason="; ".join(cbuild.missing_tools()) or "tools found")
def test_first_use_build_compiles_into_the_cache(fresh, monkeypatch, caplog):
    """The build a GPU user's first call runs (here for sm_90a alone, ~45 s on two cores)."""
    monkeypatch.setattr(cbuild, "DEFAULT_ARCHS", "90a")
    caplog.set_level(logging.INFO, logger="dsv41_jax")
    assert cuda_ffi.backend_unavailable_reason() is None  # built, loaded, and (simulated) on a GPU
    lib = cbuild.cached_library_path()
    assert lib.is_file() and cuda_ffi.library_path() == lib and lib.parent.parent == fresh / "cache"
    assert not (lib.parent / "build").exists() and not (lib.parent / "stage").exists()
    # progress at WARNING, which Python shows without any logging set up
    msgs = [r.getMessage() for r in caplog.records if r.name.startswith("dsv41_jax") and r.levelno == logging.WARNING]
    assert any("building the CUDA kernels (archs 90a)" in m for m in msgs) and any("built " in m for m in msgs)
    record = json.loads((lib.parent / cbuild.INFO_NAME).read_text())
    assert record["archs"] == ["90a"] and "release" in record["nvcc"] and record["source_key"] == lib.parent.name
    assert record["commit"] is None or len(record["commit"]) == 40
    assert cuda_ffi.build_info() == record
    # the implementation is installed, and a second process-level ask reuses the build
    assert "cuda" in implementations.decode_impls() and "cuda" in implementations.prefill_impls()
    monkeypatch.setattr(cbuild, "build_library", lambda **kw: pytest.fail("built twice"))
    assert cbuild.build_cached() == lib


def test_sources_live_in_csrc_and_ship_as_package_data():
    # the build reads csrc/ only, and pyproject's package data names every file kind the build reads there
    import tomllib

    assert (cbuild.CSRC / "CMakeLists.txt").is_file() and (cbuild.CSRC / "kernels.cuh").is_file()
    data = tomllib.loads((cbuild.HERE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert {f"csrc/{g}" for g in cbuild.SOURCE_GLOBS} <= set(data["cuda_ffi"])
    # the product's sources hold no experiment switch and no planted-bug hook (those are patches: benchmarks/, tests/)
    for path in cbuild.CSRC.iterdir():
        text = path.read_text()
        assert "DSV41_EXP_" not in text and "DSV41_TEST_PLANT" not in text, path.name


def test_copy_sources_applies_each_patch_exactly_once(tmp_path):
    dst = cbuild.copy_sources(tmp_path / "a", (("pair.cuh", "if constexpr (C::ncta == 2) cluster_sync();", "/*x*/"),))
    assert "/*x*/" in (dst / "pair.cuh").read_text() and (dst / "CMakeLists.txt").is_file()
    with pytest.raises(cbuild.BuildError, match="0 times"):
        cbuild.copy_sources(tmp_path / "b", (("pair.cuh", "no such snippet", ""),))
    with pytest.raises(ValueError):
        cbuild.copy_sources(cbuild.CSRC)


def test_every_ablation_patch_still_applies(tmp_path):
    from benchmarks.cuda_ablations import ABLATIONS

    for name, ablation in ABLATIONS.items():
        cbuild.copy_sources(tmp_path / name, ablation.patches)


def test_a_build_folder_configured_from_other_sources_is_emptied(tmp_path):
    from cuda_ffi import build as cbuild

    build_dir, src = tmp_path / "build", tmp_path / "src"
    build_dir.mkdir()
    src.mkdir()
    (build_dir / "stale.o").write_text("x")
    (build_dir / "CMakeCache.txt").write_text(f"CMAKE_HOME_DIRECTORY:INTERNAL={tmp_path / 'old'}\n")
    cbuild._drop_foreign_cache(build_dir, src)
    assert not build_dir.exists()
    build_dir.mkdir()
    (build_dir / "CMakeCache.txt").write_text(f"CMAKE_HOME_DIRECTORY:INTERNAL={src}\n")
    cbuild._drop_foreign_cache(build_dir, src)
    assert (build_dir / "CMakeCache.txt").exists()
