"""Weights of `DeepseekV41Model` in Hugging Face DeepSeek-V4.1 names, to and from safetensors.

Names (torch layout: a Linear weight is `[out, in]`, the transpose of our `Dense.kernel`):

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

`load_safetensors` checks the whole set before touching the model: every expected tensor present,
every shape right; it raises `ValueError` listing missing, unexpected (with `strict=True`) and
mis-shaped tensors by name.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.nn import DeepseekV41Model

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


def save_safetensors(model: DeepseekV41Model, path: str) -> None:
    """Write every parameter to one safetensors file in HF names (float32)."""
    from safetensors.numpy import save_file

    save_file(hf_state_dict(model), path)


def _files(path: str | os.PathLike | Iterable[str]) -> list[str]:
    if isinstance(path, (str, os.PathLike)):
        path = os.fspath(path)
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    names = sorted(set(json.load(f)["weight_map"].values()))
                return [os.path.join(path, n) for n in names]
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise ValueError(f"no *.safetensors file in directory {path!r}")
            return files
        if not os.path.exists(path):
            raise ValueError(f"weights file {path!r} does not exist")
        return [path]
    return [os.fspath(p) for p in path]


def load_safetensors(model: DeepseekV41Model, path, *, strict: bool = True) -> DeepseekV41Model:
    """Load HF-named tensors into `model` (in place; returns it).

    `path`: a .safetensors file, a directory (sharded checkpoints with or without
    `model.safetensors.index.json`), or a list of files. With `strict`, tensors the model does not
    have are an error too. Values are cast to each parameter's dtype.
    """
    from safetensors import safe_open

    params = _params(model)
    wanted = {}
    for p, var in params.items():
        name, kind = _hf_name(p)
        shape = tuple(var[...].shape)
        hf_shape = shape[::-1] if kind == "transpose" else ((shape[0] * shape[1], shape[2]) if kind == "wo_a" else shape)
        wanted[name] = (p, kind, hf_shape)
    found: dict[str, tuple[str, tuple]] = {}
    for f in _files(path):
        with safe_open(f, framework="numpy") as fh:
            for k in fh.keys():
                found[k] = (f, tuple(fh.get_slice(k).get_shape()))
    missing = sorted(set(wanted) - set(found))
    unexpected = sorted(set(found) - set(wanted)) if strict else []
    bad = [f"{n}: expected shape {wanted[n][2]}, got {found[n][1]}" for n in sorted(set(wanted) & set(found))
           if found[n][1] != wanted[n][2]]
    if missing or unexpected or bad:
        lines = []
        if missing:
            lines.append(f"missing tensors ({len(missing)}): " + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else ""))
        if unexpected:
            lines.append(f"unexpected tensors ({len(unexpected)}): " + ", ".join(unexpected[:20]))
        lines += [f"mis-shaped tensor {b}" for b in bad]
        raise ValueError("cannot load weights:\n  " + "\n  ".join(lines))
    handles = {}
    try:
        for name, (p, kind, _) in wanted.items():
            f = found[name][0]
            if f not in handles:
                handles[f] = safe_open(f, framework="numpy")
            a = handles[f].get_tensor(name)
            var = params[p]
            if kind == "transpose":
                a = a.T
            elif kind == "wo_a":
                a = a.reshape(var[...].shape)
            var[...] = jnp.asarray(a, var[...].dtype)
    finally:
        handles.clear()
    return model
