"""Inputs shared by the benchmarks: a cache filled with random latents, per-request indices, the commit."""

from __future__ import annotations

import contextlib
import os
import subprocess

import jax
import jax.numpy as jnp

from dsv41_jax import kv_cache as kvc


def filled_cache(key, n_tokens: int, block_size: int, fmt: str) -> tuple[jax.Array, int]:
    """A cache of ceil(n_tokens / block_size) pages, every slot holding a random N(0, 1) latent; and its capacity."""
    nb = -(-n_tokens // block_size)
    rows = jax.random.normal(key, (nb * block_size, 512), jnp.float32).astype(jnp.bfloat16)
    fill = jax.jit(lambda c, r: kvc.insert(c, r, jnp.arange(nb * block_size, dtype=jnp.int32), kv_format=fmt,
                                           block_size=block_size), donate_argnums=0)
    return fill(kvc.allocate(nb, block_size, fmt), rows), nb * block_size


def request_indices(key, b: int, s_q: int, topk: int, capacity: int) -> jax.Array:
    """int32 [b, s_q, topk]: request i draws its slots from its own region of the cache, as real sequences do."""
    per = capacity // b
    base = (jnp.arange(b) * per)[:, None, None]
    return (base + jax.random.randint(key, (b, s_q, topk), 0, per)).astype(jnp.int32)


PALLAS_CTAS_HELP = ("the pallas kernels as persistent CTAs: at most N, or 'sms' (one per SM); "
                    "`pallas_kernels.kernel_options(ctas=...)`")


def pallas_ctas(value: str | None):
    """The context of a benchmark's `--pallas-ctas` (PALLAS_CTAS_HELP): persistent pallas CTAs, or None: as they are."""
    if value is None:
        return contextlib.nullcontext()
    import pallas_kernels

    return pallas_kernels.kernel_options(ctas=value if value == "sms" else int(value))


def git_commit() -> str:
    """$DSV41_COMMIT (the device machine gets the tree without .git), else `git rev-parse`, else "unknown"."""
    if os.environ.get("DSV41_COMMIT"):
        return os.environ["DSV41_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        return out or "unknown"
    except OSError:
        return "unknown"
