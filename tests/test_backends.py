"""Backend descriptors (the seed's capability flags), supports_combination and select_backend
(`dsv41_jax.sparse_mla.capabilities`, also at its old path `dsv41_jax.backends`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax import (
    AUTO_ORDER,
    CUDA_SPARSE_DSV41,
    FLASHMLA_MEGA_ATTN_DSV41,
    FLASHMLA_SPARSE_DSV41,
    PALLAS_SPARSE_DSV41,
    XLA_SPARSE_DSV41,
    BackendSelectionError,
    BackendSpec,
    DeviceInfo,
    backends,
    canonical_kv_cache_dtype,
    register_backend,
    registered_backends,
    select_backend,
)
from dsv41_jax.sparse_mla import capabilities, implementations
from dsv41_jax.sparse_mla.capabilities import BUILTIN_BACKENDS, auto_order

SM90, SM100, SM80, SM120 = (9, 0), (10, 0), (8, 0), (12, 0)


@pytest.fixture
def isolated_registry(monkeypatch):
    """Let a test add backends without touching the global registry."""
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))


def combo(spec, **kw):
    args = dict(head_size=512, dtype=jnp.bfloat16, kv_cache_dtype="auto", block_size=None, use_mla=True,
                has_sink=True, use_sparse=True, use_mm_prefix=False, device_capability=SM90)
    args.update(kw)
    return spec.supports_combination(**args)


# ------------------------------------------------------------------------- descriptors
def test_flashmla_sparse_flags():
    s = FLASHMLA_SPARSE_DSV41
    assert s.name == "FLASHMLA_SPARSE_DSV41"
    assert tuple(s.supported_dtypes) == ("bfloat16",)
    assert tuple(s.supported_kv_cache_dtypes) == ("auto", "fp8_ds_mla", "fp8")
    assert tuple(s.supported_head_sizes) == (512,)
    assert s.is_mla and s.is_sparse and s.supports_sink
    assert s.supports_compute_capability(SM90) and s.supports_compute_capability(SM100)
    assert s.supports_compute_capability((9, 4)) and s.supports_compute_capability((10, 3))
    assert not s.supports_compute_capability(SM80) and not s.supports_compute_capability(SM120)
    assert not s.supports_compute_capability(None)
    assert tuple(s.get_supported_kernel_block_sizes(SM90)) == (64,)
    assert tuple(s.get_supported_kernel_block_sizes(SM100)) == (128,)
    for kv in ("auto", "fp8_ds_mla", "fp8"):
        assert s.supports_kv_cache_dtype(kv)
    for kv in ("bf16", "nvfp4_ds_mla", "mxfp8_ds_mla", "fp8_e4m3"):
        assert not s.supports_kv_cache_dtype(kv)
    assert "sparse" in s.interfaces


def test_flashmla_mega_flags():
    s = FLASHMLA_MEGA_ATTN_DSV41
    assert s.name == "FLASHMLA_MEGA_ATTN_DSV41"
    assert tuple(s.supported_kv_cache_dtypes) == ("auto", "fp8_ds_mla", "fp8", "nvfp4_ds_mla")
    assert tuple(s.supported_dtypes) == ("bfloat16",) and tuple(s.supported_head_sizes) == (512,)
    assert s.is_mla and s.is_sparse and s.supports_sink
    assert s.supports_compute_capability(SM100) and s.supports_compute_capability((10, 3))
    assert not s.supports_compute_capability(SM90) and not s.supports_compute_capability(SM120)
    assert tuple(s.get_supported_kernel_block_sizes(SM100)) == (128,)
    assert s.interfaces == ("mega",)


def test_reference_backends_flags():
    assert XLA_SPARSE_DSV41.impl == "xla" and XLA_SPARSE_DSV41.platforms is None
    assert XLA_SPARSE_DSV41.get_supported_kernel_block_sizes(SM90) is None
    for kv in ("bf16", "fp8_ds_mla", "mxfp8_ds_mla", "nvfp4_ds_mla"):
        assert XLA_SPARSE_DSV41.supports_kv_cache_dtype(kv)
    assert PALLAS_SPARSE_DSV41.impl == "pallas"
    names = [s.name for s in registered_backends()]
    assert set(names) >= {"FLASHMLA_SPARSE_DSV41", "FLASHMLA_MEGA_ATTN_DSV41", "PALLAS_SPARSE_DSV41",
                          "XLA_SPARSE_DSV41"}
    prios = [s.priority for s in registered_backends()]
    assert prios == sorted(prios, reverse=True)


def test_descriptors_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        FLASHMLA_SPARSE_DSV41.priority = 100  # type: ignore[misc]


# ------------------------------------------------------------------- supports_combination
def test_supports_combination_ok():
    assert combo(FLASHMLA_SPARSE_DSV41) is None
    assert combo(FLASHMLA_SPARSE_DSV41, block_size=64) is None
    assert combo(FLASHMLA_SPARSE_DSV41, block_size=128, device_capability=SM100) is None
    assert combo(FLASHMLA_SPARSE_DSV41, kv_cache_dtype="fp8", dtype="bfloat16") is None
    assert combo(FLASHMLA_SPARSE_DSV41, kv_cache_dtype=None, has_sink=False) is None
    assert combo(FLASHMLA_MEGA_ATTN_DSV41, device_capability=SM100, block_size=128,
                 kv_cache_dtype="nvfp4_ds_mla") is None


@pytest.mark.parametrize("spec,kw,word", [
    (FLASHMLA_SPARSE_DSV41, dict(head_size=576), "head_size"),
    (FLASHMLA_SPARSE_DSV41, dict(dtype=jnp.float16), "dtype"),
    (FLASHMLA_SPARSE_DSV41, dict(dtype=np.float32), "dtype"),
    (FLASHMLA_SPARSE_DSV41, dict(kv_cache_dtype="bf16"), "kv_cache_dtype"),
    (FLASHMLA_SPARSE_DSV41, dict(kv_cache_dtype="nvfp4_ds_mla"), "kv_cache_dtype"),
    (FLASHMLA_SPARSE_DSV41, dict(use_mla=False), "MLA"),
    (FLASHMLA_SPARSE_DSV41, dict(use_sparse=False), "sparse"),
    (FLASHMLA_SPARSE_DSV41, dict(use_mm_prefix=True), "multimodal"),
    (FLASHMLA_SPARSE_DSV41, dict(device_capability=SM80), "compute capability"),
    (FLASHMLA_SPARSE_DSV41, dict(device_capability=None), "compute capability"),
    (FLASHMLA_SPARSE_DSV41, dict(block_size=128), "block_size"),  # SM90 kernel pages are 64
    (FLASHMLA_SPARSE_DSV41, dict(block_size=64, device_capability=SM100), "block_size"),
    (FLASHMLA_MEGA_ATTN_DSV41, dict(device_capability=SM90), "compute capability"),
    (FLASHMLA_MEGA_ATTN_DSV41, dict(device_capability=SM100, block_size=64), "block_size"),
    (FLASHMLA_MEGA_ATTN_DSV41, dict(device_capability=SM100, kv_cache_dtype="bf16"), "kv_cache_dtype"),
])
def test_supports_combination_reasons(spec, kw, word):
    reason = combo(spec, **kw)
    assert isinstance(reason, str) and word in reason


# ------------------------------------------------------------------------ select_backend
@pytest.mark.parametrize("kw,want", [
    (dict(platform="cuda", compute_capability="9.0", block_size=64), "FLASHMLA_SPARSE_DSV41"),
    (dict(platform="cuda", compute_capability=(9, 0)), "FLASHMLA_SPARSE_DSV41"),
    (dict(platform="gpu", compute_capability=90, kv_cache_dtype="fp8"), "FLASHMLA_SPARSE_DSV41"),
    (dict(platform="cuda", compute_capability="10.0", block_size=128), "FLASHMLA_SPARSE_DSV41"),
    (dict(platform="cuda", compute_capability="10.0", block_size=128, mega=True), "FLASHMLA_MEGA_ATTN_DSV41"),
    (dict(platform="cuda", compute_capability="10.0", kv_cache_dtype="nvfp4_ds_mla", mega=True),
     "FLASHMLA_MEGA_ATTN_DSV41"),
    # the SM90 FlashMLA envelope is 64-token fp8 pages: other sizes and bf16 caches go to our own CUDA kernels
    # (any page size), then to Pallas when CUDA is excluded
    (dict(platform="cuda", compute_capability="9.0", block_size=128), "CUDA_SPARSE_DSV41"),
    (dict(platform="cuda", compute_capability="9.0", block_size=61), "CUDA_SPARSE_DSV41"),
    (dict(platform="cuda", compute_capability="9.0", kv_cache_dtype="bf16"), "CUDA_SPARSE_DSV41"),
    (dict(platform="cuda", compute_capability="9.0", block_size=61, impls=("pallas", "xla")), "PALLAS_SPARSE_DSV41"),
    # V4.1's records: our CUDA kernels (FlashMLA reads them on SM100 only), then Pallas
    (dict(platform="cuda", compute_capability="9.0", kv_cache_dtype="mxfp8_ds_mla"), "CUDA_SPARSE_DSV41"),
    (dict(platform="cuda", compute_capability="9.0", kv_cache_dtype="mxfp8_ds_mla", impls=("pallas", "xla")),
     "PALLAS_SPARSE_DSV41"),
    (dict(platform="cuda", compute_capability="9.0", kv_cache_dtype="nvfp4_ds_mla", impls=("pallas", "xla")),
     "PALLAS_SPARSE_DSV41"),
    (dict(platform="cuda", compute_capability="9.0", mega=True), "CUDA_SPARSE_DSV41"),  # our SM90 mega decode
    (dict(platform="cuda", compute_capability="9.0", mega=True, impls=("pallas", "xla")), "PALLAS_SPARSE_DSV41"),
    (dict(platform="cuda", compute_capability="9.0", mega=True, impls=("xla",)), "XLA_SPARSE_DSV41"),
    (dict(platform="cuda", compute_capability="8.0"), "XLA_SPARSE_DSV41"),
    (dict(platform="cuda", compute_capability="12.0", block_size=64), "XLA_SPARSE_DSV41"),
    (dict(platform="cpu"), "XLA_SPARSE_DSV41"),
    (dict(platform="tpu", block_size=3), "XLA_SPARSE_DSV41"),
    (dict(platform="cuda", compute_capability="9.0", impls=["pallas", "xla"]), "PALLAS_SPARSE_DSV41"),
    (dict(platform="cuda", compute_capability="9.0", impls=("xla",)), "XLA_SPARSE_DSV41"),
])
def test_select_backend(kw, want):
    assert select_backend(require_available=False, **kw).name == want


def test_select_backend_with_device_info():
    info = DeviceInfo("cuda", SM90, 132)
    assert select_backend(info, block_size=64, require_available=False) is FLASHMLA_SPARSE_DSV41
    assert select_backend(DeviceInfo("cpu"), require_available=False) is XLA_SPARSE_DSV41
    # the default device here is a CPU
    assert select_backend(require_available=False) is XLA_SPARSE_DSV41
    assert select_backend(jax.devices("cpu")[0]) is XLA_SPARSE_DSV41


def test_selection_error_lists_every_candidate():
    with pytest.raises(BackendSelectionError) as e:
        select_backend(platform="cuda", compute_capability="9.0", head_size=576, require_available=False)
    err = e.value
    assert isinstance(err, ValueError)
    names = {s.name for s in registered_backends()}
    assert set(err.reasons) == names
    for name in names:
        assert name in str(err)
        assert any("head_size 576" in r for r in err.reasons[name])
    # every reason of a rejected backend is listed, not just the first
    with pytest.raises(BackendSelectionError) as e:
        select_backend(platform="cpu", impls=["cuda"], block_size=7, require_available=False)
    r = e.value.reasons["FLASHMLA_SPARSE_DSV41"]
    assert any("platform" in x for x in r) and any("compute capability" in x for x in r)
    assert any("implementation" in x for x in e.value.reasons["XLA_SPARSE_DSV41"])


def test_selection_error_mega_on_cpu_without_xla():
    with pytest.raises(BackendSelectionError) as e:
        select_backend(platform="cpu", mega=True, impls=["cuda", "pallas"], require_available=False)
    reasons = e.value.reasons
    assert any("mega" in x for x in reasons["FLASHMLA_SPARSE_DSV41"])
    assert any("platform" in x for x in reasons["FLASHMLA_MEGA_ATTN_DSV41"])


def test_require_available_rejects_unbuilt_impls(monkeypatch):
    import cuda_ffi
    import pallas_kernels

    # an implementation whose package does not import is rejected with the import error
    monkeypatch.delitem(implementations._loaded, "cuda", raising=False)
    monkeypatch.setitem(implementations._import_errors, "cuda", "import cuda_ffi failed: ImportError: test")
    monkeypatch.setattr(pallas_kernels, "unavailable_reason", lambda: "pallas: no GPU (test)")
    got = select_backend(platform="cuda", compute_capability="9.0", block_size=64)
    assert got is XLA_SPARSE_DSV41
    with pytest.raises(BackendSelectionError) as e:
        select_backend(platform="cuda", compute_capability="9.0", block_size=64, impls=["cuda"])
    assert any("import cuda_ffi failed" in x for x in e.value.reasons["FLASHMLA_SPARSE_DSV41"])
    monkeypatch.undo()
    # once the implementation reports itself available, it is picked
    implementations.load("cuda")
    monkeypatch.setattr(cuda_ffi, "unavailable_reason", lambda: None)
    assert select_backend(platform="cuda", compute_capability="9.0", block_size=64) is FLASHMLA_SPARSE_DSV41
    monkeypatch.setattr(cuda_ffi, "unavailable_reason", lambda: "libdsv41_cuda.so not built")
    with pytest.raises(BackendSelectionError) as e:
        select_backend(platform="cuda", compute_capability="9.0", block_size=64, impls=["cuda"])
    assert "libdsv41_cuda.so not built" in e.value.reasons["FLASHMLA_SPARSE_DSV41"]

    def boom():
        raise RuntimeError("probe exploded")

    monkeypatch.setattr(cuda_ffi, "unavailable_reason", boom)
    with pytest.raises(BackendSelectionError) as e:
        select_backend(platform="cuda", compute_capability="9.0", block_size=64, impls=["cuda"])
    assert any("probe exploded" in x for x in e.value.reasons["FLASHMLA_SPARSE_DSV41"])


def test_the_mega_descriptor_is_flashmlas_and_ours_serves_the_mega_interface():
    """FLASHMLA_MEGA_ATTN_DSV41 records FlashMLA's fused SM100 kernel (no kernel of this library); the mega decode
    runs CUDA_SPARSE_DSV41's kernels where they are available, then PALLAS_SPARSE_DSV41's, else the xla reference."""
    assert FLASHMLA_MEGA_ATTN_DSV41.impl is None and "CUDA_SPARSE_DSV41's fused decode" in FLASHMLA_MEGA_ATTN_DSV41.notes
    assert "PALLAS_SPARSE_DSV41's" in FLASHMLA_MEGA_ATTN_DSV41.notes
    assert "mega" in CUDA_SPARSE_DSV41.interfaces and "mega" in PALLAS_SPARSE_DSV41.interfaces
    sm100_mega = dict(platform="cuda", compute_capability="10.0", block_size=128, mega=True)
    assert select_backend(**sm100_mega, require_available=False) is FLASHMLA_MEGA_ATTN_DSV41  # the capability
    assert select_backend(**sm100_mega, impls=["cuda"], require_available=False) is CUDA_SPARSE_DSV41
    assert select_backend(**sm100_mega, impls=["pallas"], require_available=False) is PALLAS_SPARSE_DSV41
    assert select_backend(**sm100_mega, impls=["pallas", "xla"]) is XLA_SPARSE_DSV41  # no GPU here: pallas cannot run
    with pytest.raises(BackendSelectionError) as e:
        select_backend(**sm100_mega, impls=["pallas"])
    assert e.value.reasons["PALLAS_SPARSE_DSV41"], e.value.reasons


def test_auto_order_comes_from_the_priorities():
    assert backends is capabilities  # the old path is the module itself
    assert AUTO_ORDER == ("cuda", "pallas", "xla") == auto_order(BUILTIN_BACKENDS)
    assert set(AUTO_ORDER) == set(implementations.IMPLEMENTATIONS)
    flipped = [dataclasses.replace(s, priority=100) if s.impl == "pallas" else s for s in BUILTIN_BACKENDS]
    assert auto_order(flipped) == ("pallas", "cuda", "xla")
    with pytest.raises(ValueError, match="spec.impl"):
        register_backend(dataclasses.replace(XLA_SPARSE_DSV41, name="TEST_TRITON", impl="triton"))


def test_register_backend(isolated_registry):
    custom = BackendSpec(
        name="TEST_CUSTOM", impl="xla", priority=1000, supported_dtypes=("bfloat16",),
        supported_kv_cache_dtypes=("bf16",), supported_head_sizes=(512,), platforms=("cpu",),
        compute_capability_majors=None, kernel_block_sizes=lambda cc: (3,),
    )
    register_backend(custom)
    assert registered_backends()[0] is custom
    assert backends.get_backend("TEST_CUSTOM") is custom
    assert select_backend(platform="cpu", kv_cache_dtype="bf16", block_size=3) is custom
    assert select_backend(platform="cpu", kv_cache_dtype="bf16", block_size=4) is XLA_SPARSE_DSV41
    with pytest.raises(ValueError, match="TEST_CUSTOM"):
        register_backend(custom)
    register_backend(dataclasses.replace(custom, priority=-1), replace=True)
    assert registered_backends()[-1].name == "TEST_CUSTOM"
    with pytest.raises(TypeError):
        register_backend("TEST_CUSTOM")
    with pytest.raises(ValueError, match="NOPE"):
        backends.get_backend("NOPE")


def test_registry_untouched_after_isolated_tests():
    assert "TEST_CUSTOM" not in {s.name for s in registered_backends()}


# ---------------------------------------------------------------------------- argument errors
def test_select_backend_argument_errors():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        select_backend(platform="cpu", kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="device"):
        select_backend(DeviceInfo("cpu"), platform="cpu")
    with pytest.raises(ValueError, match="block_size"):
        select_backend(platform="cpu", block_size=0)
    with pytest.raises(TypeError, match="block_size"):
        select_backend(platform="cpu", block_size="64")
    with pytest.raises(TypeError, match="block_size"):
        select_backend(platform="cpu", block_size=True)
    with pytest.raises(TypeError, match="platform"):
        select_backend(platform=9)
    with pytest.raises(ValueError, match="compute_capability"):
        select_backend(platform="cuda", compute_capability="sm90")


def test_canonical_kv_cache_dtype():
    assert canonical_kv_cache_dtype("fp8") == "fp8_ds_mla"
    assert canonical_kv_cache_dtype("auto") == "fp8_ds_mla"
    assert canonical_kv_cache_dtype("bfloat16") == "bf16"
    for f in ("bf16", "fp8_ds_mla", "mxfp8_ds_mla", "nvfp4_ds_mla"):
        assert canonical_kv_cache_dtype(f) == f
    with pytest.raises(ValueError, match="fp9"):
        canonical_kv_cache_dtype("fp9")
    with pytest.raises(TypeError):
        canonical_kv_cache_dtype(None)


class _FakeDevice:
    def __init__(self, platform, cc=None, cores=None):
        self.platform = platform
        if cc is not None:
            self.compute_capability = cc
        if cores is not None:
            self.core_count = cores


@pytest.mark.parametrize("dev,want", [
    (_FakeDevice("gpu", "9.0", 132), DeviceInfo("cuda", (9, 0), 132)),
    (_FakeDevice("cuda", "10.0", 148), DeviceInfo("cuda", (10, 0), 148)),
    (_FakeDevice("cuda", 90), DeviceInfo("cuda", (9, 0), None)),
    (_FakeDevice("cuda", (12, 1)), DeviceInfo("cuda", (12, 1), None)),
    (_FakeDevice("cpu"), DeviceInfo("cpu", None, None)),
    (_FakeDevice("tpu", "9.0"), DeviceInfo("tpu", None, None)),
])
def test_device_info_from_device(dev, want):
    assert DeviceInfo.from_device(dev) == want


def test_device_info_from_jax_device():
    info = DeviceInfo.from_device(jax.devices("cpu")[0])
    assert info.platform == "cpu" and info.compute_capability is None
    assert DeviceInfo.default().platform == jax.devices()[0].platform
    with pytest.raises(TypeError):
        DeviceInfo.from_device(object())
    with pytest.raises(TypeError, match="compute_capability"):
        DeviceInfo.from_device(_FakeDevice("cuda", 9.5))
