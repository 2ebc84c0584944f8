"""Weights in Hugging Face names to and from safetensors, one file or a sharded checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from dsv41_jax.model import weights
from dsv41_jax.model.nn import DeepseekV41Model
from tests.model.cases import CFG, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_weights_roundtrip_and_errors(model, tmp_path):
    p = tmp_path / "model.safetensors"
    assert weights.save_safetensors(model, str(p)) == [str(p)]
    other = DeepseekV41Model(CFG, rngs=nnx.Rngs(7))
    weights.load_safetensors(other, str(p))
    a, b = weights.hf_state_dict(model), weights.hf_state_dict(other)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert a["model.layers.1.self_attn.wo_a.weight"].shape == (CFG.o_groups * CFG.o_lora_rank, 4 * 512 // 2)
    assert "model.layers.2.self_attn.compressor.wkv.weight" not in a  # a sharing layer owns no compressor
    assert "model.layers.4.self_attn.indexer.wk.weight" not in a  # nor does a non-kv index source own wk

    from safetensors.numpy import save_file

    missing = dict(a)
    missing.pop("model.layers.3.self_attn.indexer.wk.weight")
    save_file(missing, str(tmp_path / "missing.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors \(1\), looked for in file .*missing.safetensors: "
                                         r"model.layers.3.self_attn.indexer.wk.weight"):
        weights.load_safetensors(other, str(tmp_path / "missing.safetensors"))
    bad = dict(a)
    bad["model.layers.0.self_attn.wq_a.weight"] = np.zeros((3, 3), np.float32)
    save_file(bad, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"mis-shaped tensor model.layers.0.self_attn.wq_a.weight in "
                                         r".*bad.safetensors: expected shape \(64, 128\), got \(3, 3\)"):
        weights.load_safetensors(other, str(tmp_path / "bad.safetensors"))
    extra = dict(a)
    extra["model.layers.9.mlp.up_proj.weight"] = np.zeros((2, 2), np.float32)
    save_file(extra, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensors .*model.layers.9.mlp.up_proj.weight in .*extra"):
        weights.load_safetensors(other, str(tmp_path / "extra.safetensors"))
    weights.load_safetensors(other, str(tmp_path / "extra.safetensors"), strict=False)
    with pytest.raises(ValueError, match="does not exist"):
        weights.load_safetensors(other, str(tmp_path / "nope.safetensors"))


def _load_equal(model, path):
    other = DeepseekV41Model(CFG, rngs=nnx.Rngs(7))
    weights.load_safetensors(other, path)
    a, b = weights.hf_state_dict(model), weights.hf_state_dict(other)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_sharded_checkpoint_through_its_index(model, tmp_path):
    import json

    from safetensors.numpy import save_file

    ckpt = tmp_path / "ckpt"
    files = weights.save_safetensors(model, ckpt, max_shard_size="1MB")
    index = ckpt / "model.safetensors.index.json"
    shards = sorted(f for f in files if f.endswith(".safetensors"))
    assert str(index) in files and len(shards) > 3
    assert shards[0].endswith(f"model-00001-of-{len(shards):05d}.safetensors")
    imap = json.loads(index.read_text())
    a = weights.hf_state_dict(model)
    assert set(imap["weight_map"]) == set(a) and imap["metadata"]["total_size"] == sum(v.nbytes for v in a.values())
    _load_equal(model, ckpt)  # the directory
    _load_equal(model, str(index))  # the index itself
    one = tmp_path / "one"
    assert weights.save_safetensors(model, one, max_shard_size="1GB") == [str(one / "model.safetensors")]
    _load_equal(model, one)  # a directory of one file, no index

    name = "model.layers.3.self_attn.indexer.wk.weight"
    shard = ckpt / imap["weight_map"][name]
    other = DeepseekV41Model(CFG, rngs=nnx.Rngs(7))
    # a tensor the index does not list: missing, and looked for in the index
    broken = dict(imap, weight_map={k: v for k, v in imap["weight_map"].items() if k != name})
    index.write_text(json.dumps(broken))
    with pytest.raises(ValueError, match=f"{shard.name} holds 1 tensors the index does not list: {name}"):
        weights.load_safetensors(other, ckpt)
    # the index maps a tensor to a shard that does not hold it
    wrong = next(f for f in imap["weight_map"].values() if f != shard.name)
    index.write_text(json.dumps(dict(imap, weight_map={**imap["weight_map"], name: wrong})))
    with pytest.raises(ValueError, match=f"{wrong} does not hold 1 tensors the index maps to it: {name}"):
        weights.load_safetensors(other, ckpt)
    # a tensor in no shard and not in the index: missing, looked for in the index's weight_map
    held = {k: v for k, v in a.items() if imap["weight_map"][k] == shard.name and k != name}
    save_file(held, str(shard))
    index.write_text(json.dumps(broken))
    with pytest.raises(ValueError, match=f"missing tensors \\(1\\), looked for in the weight_map of .*{index.name}: "
                                         f"{name}"):
        weights.load_safetensors(other, ckpt)
    # a mis-shaped tensor names its shard
    save_file({**held, name: np.zeros((2, 2), np.float32)}, str(shard))
    index.write_text(json.dumps(imap))
    with pytest.raises(ValueError, match=f"mis-shaped tensor {name} in .*{shard.name}: expected shape"):
        weights.load_safetensors(other, ckpt)
    # a shard the index names is gone
    shard.unlink()
    with pytest.raises(ValueError, match=f"names shards that do not exist: .*{shard.name} \\(for"):
        weights.load_safetensors(other, ckpt)
    with pytest.raises(ValueError, match="max_shard_size"):
        weights.save_safetensors(model, tmp_path / "x", max_shard_size="lots")
