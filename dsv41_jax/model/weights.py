"""Weights of `DeepseekV41Model` in Hugging Face DeepSeek-V4.1 names, to and from safetensors.

Names (torch layout: a Linear weight is `[out, in]`, the transpose of `Dense.kernel`):

    model.embed_tokens.weight                      model.norm.weight           lm_head.weight
    model.layers.{i}.input_layernorm.weight        model.layers.{i}.post_attention_layernorm.weight
    model.layers.{i}.self_attn.{wq_a,wq_b,wkv,wo_b}.weight
    model.layers.{i}.self_attn.{q_norm,kv_norm}.weight
    model.layers.{i}.self_attn.attn_sink                               [H]
    model.layers.{i}.self_attn.wo_a.weight                             [o_groups * o_lora_rank, H * 512 / o_groups]
    model.layers.{i}.self_attn.compressor.{wkv,wgate,norm}.weight      (kv-source layers; wgate for ratio 2)
    model.layers.{i}.self_attn.indexer.{wq_b,weights_proj}.weight      (index-source layers)
    model.layers.{i}.self_attn.indexer.{wk,k_norm}.weight              (index sources that are kv sources)
    model.layers.{i}.mlp.{gate_proj,up_proj,down_proj}.weight

`load_safetensors` reads one file, a directory or a sharded checkpoint through its
`model.safetensors.index.json` (`dsv41_jax.model.checkpoint`), and checks the whole set before touching the
model: every expected tensor present, every shape right; it raises `ValueError` listing missing (and
where they were looked for), unexpected (with `strict=True`) and mis-shaped tensors by name and file.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.model.checkpoint import open_checkpoint, write_checkpoint
from dsv41_jax.model.nn import DeepseekV41Model

__all__ = ["hf_state_dict", "save_safetensors", "load_safetensors", "hf_names"]


def _hf_name(path: tuple) -> tuple[str, str]:
    """(HF name, how to convert) for an NNX state path."""
    parts = [str(p) for p in path]
    kind = "copy"
    if parts[-1] == "kernel":
        parts[-1], kind = "weight", "transpose"
    if parts[-1] == "wo_a":
        parts.append("weight")
        kind = "wo_a"
    if parts[0] == "embed_tokens":
        parts.append("weight")
    if parts[0] == "lm_head":
        return ".".join(parts), kind
    return "model." + ".".join(parts), kind


def _params(model: DeepseekV41Model) -> dict[tuple, nnx.Variable]:
    return {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def hf_names(model: DeepseekV41Model) -> list[str]:
    return sorted(_hf_name(p)[0] for p in _params(model))


def hf_state_dict(model: DeepseekV41Model) -> dict[str, np.ndarray]:
    """HF-named float32 numpy arrays of every parameter (torch layout)."""
    out = {}
    for path, var in _params(model).items():
        name, kind = _hf_name(path)
        a = np.asarray(jnp.asarray(var[...], jnp.float32))
        if kind == "transpose":
            a = a.T
        elif kind == "wo_a":
            a = a.reshape(-1, a.shape[-1])
        out[name] = np.ascontiguousarray(a)
    return out


def save_safetensors(model: DeepseekV41Model, path: str | os.PathLike, *,
                     max_shard_size: int | str | None = None) -> list[str]:
    """Write every parameter in HF names (float32); returns the files written.

    Without `max_shard_size`, one file at `path`; with it (bytes, or a size like "5GB"), a directory of
    shards with `model.safetensors.index.json`, as Hugging Face's `save_pretrained` writes
    (`dsv41_jax.model.checkpoint.write_checkpoint`).
    """
    return write_checkpoint(hf_state_dict(model), path, max_shard_size=max_shard_size)


def _expected(model: DeepseekV41Model) -> dict[str, tuple[tuple, str, tuple[int, ...]]]:
    """HF name -> (NNX path, conversion, HF shape) of every parameter."""
    wanted = {}
    for p, var in _params(model).items():
        name, kind = _hf_name(p)
        shape = tuple(var[...].shape)
        hf_shape = shape[::-1] if kind == "transpose" else ((shape[0] * shape[1], shape[2]) if kind == "wo_a" else shape)
        wanted[name] = (p, kind, hf_shape)
    return wanted


def load_safetensors(model: DeepseekV41Model, path, *, strict: bool = True) -> DeepseekV41Model:
    """Load HF-named tensors into `model` (in place; returns it).

    `path`: a .safetensors file, a directory (its `model.safetensors.index.json`, else its *.safetensors
    files), an index json, or a list of files (`dsv41_jax.model.checkpoint.open_checkpoint`). Every tensor is
    checked before any is read: a `ValueError` names the missing tensors and where they were looked for,
    the unexpected ones (with `strict`) and the mis-shaped ones, each with its file. Values are cast to
    each parameter's dtype.
    """
    from safetensors import safe_open

    params = _params(model)
    wanted = _expected(model)
    ckpt = open_checkpoint(path)
    found = ckpt.tensors
    missing = sorted(set(wanted) - set(found))
    unexpected = sorted(set(found) - set(wanted)) if strict else []
    bad = [f"{n} in {found[n].file}: expected shape {wanted[n][2]}, got {found[n].shape}"
           for n in sorted(set(wanted) & set(found)) if found[n].shape != wanted[n][2]]
    if missing or unexpected or bad:
        lines = []
        if missing:
            lines.append(f"missing tensors ({len(missing)}), looked for in {ckpt.describe()}: "
                         + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else ""))
        if unexpected:
            lines.append(f"unexpected tensors ({len(unexpected)}; strict=False skips them): "
                         + ", ".join(f"{n} in {found[n].file}" for n in unexpected[:20])
                         + (" ..." if len(unexpected) > 20 else ""))
        lines += [f"mis-shaped tensor {b}" for b in bad]
        raise ValueError("cannot load weights:\n  " + "\n  ".join(lines))
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(found[name].file, []).append(name)
    for f, names in by_file.items():
        with safe_open(f, framework="numpy") as fh:
            for name in names:
                p, kind, _ = wanted[name]
                a = fh.get_tensor(name)
                var = params[p]
                if kind == "transpose":
                    a = a.T
                elif kind == "wo_a":
                    a = a.reshape(var[...].shape)
                var[...] = jnp.asarray(a, var[...].dtype)
    return model
