"""`python -m dsv41_jax.info` on a CPU: versions, devices, every implementation's state and fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

import cuda_ffi
from cuda_ffi import build as cbuild
from dsv41_jax import info
from dsv41_jax.sparse_mla.capabilities import AUTO_ORDER
from dsv41_jax.scheduler import default_num_sms

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def no_library(monkeypatch, tmp_path):
    """No CUDA library anywhere cuda_ffi looks."""
    monkeypatch.delenv("DSV41_CUDA_LIB", raising=False)
    monkeypatch.setenv("DSV41_CUDA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cuda_ffi, "_DEFAULT_LIB", tmp_path / "lib" / cbuild.LIB_NAME)
    monkeypatch.setattr(cuda_ffi, "_lib", None)  # not the library another test loaded
    monkeypatch.setattr(cuda_ffi, "_load_error", None)


def test_report_on_cpu():
    r = info.report()
    assert r.jax == jax.__version__ and r.jaxlib and r.python
    assert r.default_backend == "cpu" and r.error is None
    assert sum(dev.count for dev in r.devices) == len(jax.devices())
    assert all(dev.platform == "cpu" and dev.compute_capability is None for dev in r.devices)
    assert r.planning_sms == default_num_sms()
    assert tuple(s.impl for s in r.impls) == AUTO_ORDER
    cuda, pallas, xla = r.impls
    assert xla.usable and xla.reason is None and xla.fix is None
    assert pallas.importable and not pallas.usable and "CUDA GPU" in pallas.reason and ".[cuda]" in pallas.fix
    assert cuda.importable and not cuda.usable and "'cpu'" in cuda.reason and ".[cuda]" in cuda.fix
    assert r.cuda_library == str(cuda_ffi.library_path()) and set(r.build_tools) == {"nvcc", "cmake"}
    text = info.format_report(r)
    for word in ("jax " + jax.__version__, "implementations", "cuda", "pallas", "xla", "fix:", "CUDA library",
                 "build tools"):
        assert word in text


def test_report_without_library_or_nvcc(no_library, monkeypatch):
    monkeypatch.setattr(cbuild, "find_nvcc", lambda: None)
    cuda = info.report().impls[0]
    assert not cuda.usable and "not built" in cuda.reason and "nvcc not found" in cuda.reason
    assert "install the CUDA toolkit" in cuda.fix and "python -m cuda_ffi.build" in cuda.fix
    r = info.report()
    assert not r.cuda_library_present and r.cuda_build is None and r.build_tools["nvcc"] is None
    assert "(not built)" in info.format_report(r) and "nvcc not found" in info.format_report(r)


def test_report_reads_the_build_record(no_library, tmp_path, monkeypatch):
    lib = tmp_path / "lib" / cbuild.LIB_NAME
    lib.parent.mkdir()
    lib.write_bytes(b"")  # present (it does not load: the reason says so)
    record = {"archs": ["90a", "100a"], "nvcc": "Cuda compilation tools, release 13.0, V13.0.88",
              "commit": "0123abc", "sources_modified": True, "jax": jax.__version__, "built_at": "2026-12-03T10:00:00+00:00"}
    (lib.parent / cbuild.INFO_NAME).write_text(json.dumps(record))
    r = info.report()
    assert r.cuda_library == str(lib) and r.cuda_library_present and r.cuda_build == record
    text = info.format_report(r)
    assert "archs 90a, 100a" in text and "commit 0123abc with modified sources" in text and "release 13.0" in text
    assert "cannot load" in r.impls[0].reason


def test_main_prints_text_and_json(capsys):
    assert info.main([]) == 0
    assert "implementations, in the order impl='auto' tries them" in capsys.readouterr().out
    assert info.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [s["impl"] for s in data["impls"]] == list(AUTO_ORDER) and data["default_backend"] == "cpu"


def test_module_runs_as_a_command():
    proc = subprocess.run([sys.executable, "-m", "dsv41_jax.info"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "xla    usable" in proc.stdout and "default backend: cpu" in proc.stdout
