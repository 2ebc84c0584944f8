"""GPU tests of what the user sees about the kernel choice and the CUDA install, on an SM90 / SM100 device.

Run on the GPU machine from the repository root:
    PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_install_gpu.py

- the first-use build: a copy of the packages without a CUDA library, on a GPU with nvcc and cmake,
  builds it into the cache on the first `impl="auto"` call, logs that it does, and runs the cuda kernels
  (equal to the reference within FlashMLA's tolerance);
- `explain_impl` on the real device accepts cuda for a call the kernels serve and explains a fallback;
  a fallback to the reference on the GPU warns once on the `dsv41_jax` logger;
- `python -m dsv41_jax.info` on the GPU names the device, its SM count and the library's build.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

if jax.default_backend() != "gpu":
    pytest.skip(f"needs a CUDA GPU: jax.default_backend() is {jax.default_backend()!r}", allow_module_level=True)

import dsv41_jax as d  # noqa: E402
from dsv41_jax.sparse_mla import api  # noqa: E402
from tests.attention_cases import make_decode_case, make_mega_case  # noqa: E402

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]

_FIRST_USE = r"""
import json, logging, sys
import numpy as np
import jax
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
import dsv41_jax as d
from tests.attention_cases import make_decode_case
case = make_decode_case(5, h_q=16, topk=128, fmt="fp8_ds_mla", block_size=64)
choice = d.explain_impl(d.sparse_mla_decode, *case.args(), **case.kwargs())
out, lse = d.sparse_mla_decode(*case.args(), **case.kwargs(), impl="auto")
ref, rlse = d.sparse_mla_decode(*case.args(), **case.kwargs(), impl="xla")
import cuda_ffi
print(json.dumps({"impl": choice.impl, "lib": str(cuda_ffi.library_path()),
                  "err": float(np.max(np.abs(np.asarray(out, np.float32) - np.asarray(ref, np.float32)))),
                  "scale": float(np.max(np.abs(np.asarray(ref, np.float32))))}))
"""


@pytest.mark.slow
def test_first_use_build_on_the_gpu(tmp_path):
    # the packages copied without cuda_ffi/lib, so only the first-use build can provide the library
    for pkg in ("dsv41_jax", "cuda_ffi", "pallas_kernels", "tests"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg,
                        ignore=shutil.ignore_patterns("lib", "build", "__pycache__", "*.so"))
    env = dict(os.environ, PYTHONPATH=str(tmp_path), DSV41_CUDA_CACHE=str(tmp_path / "cache"))
    env.pop("DSV41_CUDA_LIB", None)
    env.pop("DSV41_CUDA_AUTOBUILD", None)
    r = subprocess.run([sys.executable, "-c", _FIRST_USE], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["impl"] == "cuda", (res, r.stderr[-2000:])
    assert res["lib"].startswith(str(tmp_path / "cache")), res
    assert "build" in r.stderr.lower(), r.stderr[-2000:]  # the progress message
    assert res["err"] <= 1e-2 * max(res["scale"], 1.0), res


def test_explain_on_the_gpu_accepts_cuda_and_explains_a_fallback(caplog, monkeypatch):
    case = make_decode_case(6, h_q=16, topk=128, fmt="fp8_ds_mla", block_size=64)
    choice = d.explain_impl(d.sparse_mla_decode, *case.args(), **case.kwargs())
    assert choice.device.platform == "cuda" and choice.device.compute_capability[0] in (9, 10)
    assert choice.impl == "cuda", str(choice)
    # a call no kernel runs (a mega decode over an mxfp8_ds_mla cache next to an fp8_ds_mla one: the cuda kernels
    # read one format family per call; the pallas kernels, which read any mix, are made to decline it here): the
    # reference runs, with a warning naming why each kernel declined
    import pallas_kernels

    monkeypatch.setattr(pallas_kernels, "mega_decode_supports", lambda call: "declined by the test")
    other = make_mega_case(7, h_q=16, topk=128, fmt="mxfp8_ds_mla", block_size=64,
                           extra=dict(topk=64, block_size=2, fmt="fp8_ds_mla"))
    fallback = d.explain_impl(d.sparse_mla_mega_decode, *other.args(), **other.kwargs())
    assert fallback.impl == "xla" and {c.impl for c in fallback.declined()} == {"cuda", "pallas"}, str(fallback)
    api._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="dsv41_jax"):
        d.sparse_mla_mega_decode(*other.args(), **other.kwargs(), impl="auto")
        d.sparse_mla_mega_decode(*other.args(), **other.kwargs(), impl="auto")
    warned = [r for r in caplog.records if r.name.startswith("dsv41_jax") and "runs the xla reference" in r.message]
    assert len(warned) == 1 and "cuda declined" in warned[0].message, [r.message for r in caplog.records]


def test_info_on_the_gpu():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "dsv41_jax.info", "--json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout)
    assert rep["default_backend"] == "gpu" and rep["error"] is None, rep
    gpu = rep["devices"][0]
    assert gpu["compute_capability"][0] in (9, 10) and gpu["num_sms"] == rep["planning_sms"] > 0, rep
    usable = {i["impl"]: i["usable"] for i in rep["impls"]}
    assert usable["xla"] and usable["cuda"], rep  # the library was built (gpu_check.sh's build stage)
    assert rep["cuda_library_present"] and rep["cuda_build"] and rep["cuda_build"]["archs"], rep
    text = subprocess.run([sys.executable, "-m", "dsv41_jax.info"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert text.returncode == 0 and "cuda" in text.stdout, text.stderr[-2000:]
    print(text.stdout)
