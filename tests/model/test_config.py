"""DeepseekV4AttentionConfig: presets, layer roles (loop oracle over 'latest source <= L'),
HF round trips, and every validation error naming its key."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv41_jax import PRESETS, TINY, V4_FLASH, V41_FLASH, DeepseekV4AttentionConfig, RopeScaling, get_preset

V41_RATIOS = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]


# ------------------------------------------------------------------------------- oracle
def latest_at_or_before(ids, layer):
    best = None
    for s in ids:
        if s <= layer and (best is None or s > best):
            best = s
    return best


def role_oracle(d, layer):
    """Role of `layer` from a raw V4.1 HF dict, following vllm_deepseek_v4.md 1.3."""
    ratios = list(d["compress_ratios"])
    r = ratios[layer] if layer < len(ratios) else 0  # layers beyond the list are ratio 0
    out = {"compress_ratio": r, "layer_type": {0: "swaonly", 1: "c1a", 2: "c2a"}[r],
           "is_mtp": layer >= d["num_hidden_layers"]}
    if r == 0:
        out.update(kv_source_layer=None, index_source_layer=None, candidate_source_layer=None)
    else:
        kv = latest_at_or_before(d.get("kv_source_layer_ids", []), layer)
        idx = latest_at_or_before(d.get("index_source_layer_ids", []), layer)
        cand = d.get("candidate_source_layer_id")
        # the candidate source's indexer publishes blocks; it and later indexers use them
        cand = cand if (cand is not None and idx >= cand) else None
        out.update(kv_source_layer=kv, index_source_layer=idx, candidate_source_layer=cand)
    return out


def tiny_dict():
    return {
        "dsv4_version": "v4.1",
        "hidden_size": 128,
        "num_hidden_layers": 7,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": 4,
        "head_dim": 512,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 64,
        "o_lora_rank": 64,
        "o_groups": 2,
        "sliding_window": 8,
        "compress_ratios": [0, 2, 2, 1, 1, 1, 0],
        "kv_source_layer_ids": [1, 3],
        "index_source_layer_ids": [1, 3, 5],
        "candidate_source_layer_id": 3,
        "candidate_topk_blocks": 3,
        "candidate_block_size": 2,
        "index_topk": 6,
        "index_n_heads": 2,
        "index_head_dim": 64,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32.0, "beta_slow": 1.0},
        "rms_norm_eps": 1e-6,
        "vocab_size": 256,
        "intermediate_size": 256,
        "max_position_embeddings": 4096,
    }


def v41_flash_dict():
    d = tiny_dict()
    d.update(hidden_size=5120, num_hidden_layers=40, num_nextn_predict_layers=3, num_attention_heads=64,
             q_lora_rank=1280, o_lora_rank=1024, o_groups=8, sliding_window=128,
             compress_ratios=list(V41_RATIOS), kv_source_layer_ids=[2, 8, 14, 20],
             index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36], candidate_source_layer_id=20,
             candidate_topk_blocks=2048, candidate_block_size=8, index_topk=512, index_n_heads=32,
             index_head_dim=128, rms_norm_eps=1e-20, vocab_size=129280, intermediate_size=2048,
             max_position_embeddings=1048576,
             rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                           "beta_fast": 32.0, "beta_slow": 1.0})
    return d


# ------------------------------------------------------------------------------ presets
def test_v41_flash_layer_classification():
    cfg = V41_FLASH
    assert cfg.version == "v4.1"
    assert cfg.num_layers == 43 and cfg.num_hidden_layers == 40 and cfg.num_nextn_predict_layers == 3
    types = cfg.layer_types
    assert len(types) == 43
    for i in range(43):
        if i in (0, 1, 40, 41, 42):
            want = "swaonly"
        elif 2 <= i <= 19:
            want = "c2a"
        else:
            want = "c1a"
        assert types[i] == want, i
        assert cfg.layer_role(i).layer_type == want
    assert cfg.layer_role(24).candidate_source_layer == 20


def test_v41_flash_sizes():
    cfg = V41_FLASH
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim) == (5120, 64, 512, 64)
    assert (cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups, cfg.sliding_window) == (1280, 1024, 8, 128)
    assert list(cfg.compress_ratios) == V41_RATIOS
    assert list(cfg.kv_source_layer_ids) == [2, 8, 14, 20]
    assert list(cfg.index_source_layer_ids) == [2, 8, 14, 20, 24, 28, 32, 36]
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk) == (32, 128, 512)
    assert (cfg.candidate_source_layer_id, cfg.candidate_topk_blocks, cfg.candidate_block_size) == (20, 2048, 8)
    assert cfg.rms_norm_eps == 1e-20
    assert cfg.nope_head_dim == 448
    assert math.isclose(cfg.softmax_scale, 512 ** -0.5)


def test_v41_flash_roles_match_oracle():
    d = v41_flash_dict()
    for layer in range(V41_FLASH.num_layers):
        role = V41_FLASH.layer_role(layer)
        want = role_oracle(d, layer)
        for k, v in want.items():
            assert getattr(role, k) == v, (layer, k)
        assert role.layer_id == layer
    r = V41_FLASH.layer_role
    # kv sources: latest of [2, 8, 14, 20] at or before L
    assert [r(i).kv_source_layer for i in (2, 7, 8, 13, 14, 19, 20, 39)] == [2, 2, 8, 8, 14, 14, 20, 20]
    # index sources: latest of [2, 8, 14, 20, 24, 28, 32, 36]
    assert [r(i).index_source_layer for i in (2, 9, 20, 23, 24, 27, 35, 36, 39)] == [2, 8, 20, 20, 24, 24, 32, 36, 36]
    assert r(20).owns_compressed_cache and r(20).owns_indexer and r(20).is_candidate_source
    assert r(24).owns_indexer and not r(24).owns_compressed_cache and not r(24).is_candidate_source
    assert not r(25).owns_indexer and r(25).has_compressed_cache
    assert not r(0).has_compressed_cache and r(0).kv_source_layer is None
    assert all(r(i).candidate_source_layer is None for i in range(2, 20))
    assert [r(i).is_mtp for i in (39, 40, 41, 42)] == [False, True, True, True]


def test_rope_per_layer():
    r = V41_FLASH.layer_role
    assert r(0).rope_theta == 10000.0 and not r(0).use_yarn
    assert r(2).rope_theta == 160000.0 and r(2).use_yarn
    assert r(30).rope_theta == 160000.0 and r(30).use_yarn
    assert V41_FLASH.rope_scaling == RopeScaling(16.0, 65536, 32.0, 1.0)


def test_v4_flash_preset():
    cfg = V4_FLASH
    assert cfg.version == "v4.0" and cfg.num_layers == 44
    ratios = list(cfg.compress_ratios)
    assert ratios == [0, 0] + [4, 128] * 20 + [4, 0]
    types = cfg.layer_types
    assert types[0] == types[1] == types[43] == "swaonly"
    assert all(types[i] == "c4a" for i in range(2, 43, 2))
    assert all(types[i] == "c128a" for i in range(3, 42, 2))
    assert types.count("c4a") == 21 and types.count("c128a") == 20
    assert (cfg.hidden_size, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_topk) == (4096, 1024, 64, 512)
    # V4.0: every compressed layer owns its cache; only C4A has an indexer
    assert cfg.layer_role(2).kv_source_layer == 2 and cfg.layer_role(2).index_source_layer == 2
    assert cfg.layer_role(3).kv_source_layer == 3 and cfg.layer_role(3).index_source_layer is None
    assert cfg.layer_role(0).kv_source_layer is None
    assert cfg.layer_role(43).is_mtp


def test_presets_registry():
    assert PRESETS["v4.1-flash"] is V41_FLASH and PRESETS["v4-flash"] is V4_FLASH and PRESETS["tiny"] is TINY
    assert get_preset("tiny") is TINY
    with pytest.raises(ValueError, match="nope"):
        get_preset("nope")
    with pytest.raises(dataclasses.FrozenInstanceError):
        V41_FLASH.sliding_window = 64  # type: ignore[misc]


def test_tiny_roles_match_oracle():
    d = tiny_dict()
    for layer in range(TINY.num_layers):
        role = TINY.layer_role(layer)
        for k, v in role_oracle(d, layer).items():
            assert getattr(role, k) == v, (layer, k)


def test_mtp_layers_beyond_the_list_are_ratio_0():
    d = v41_flash_dict()
    d["compress_ratios"] = V41_RATIOS[:40]  # no entries for the 3 MTP layers
    cfg = DeepseekV4AttentionConfig.from_hf_config(d)
    assert cfg.num_layers == 43 and len(cfg.compress_ratios) == 43
    for i in (40, 41, 42):
        role = cfg.layer_role(i)
        assert role.compress_ratio == 0 and role.layer_type == "swaonly" and role.is_mtp
        assert role.kv_source_layer is None
    assert cfg == V41_FLASH


def test_layer_role_errors():
    with pytest.raises(ValueError, match="layer_id"):
        V41_FLASH.layer_role(43)
    with pytest.raises(ValueError, match="layer_id"):
        V41_FLASH.layer_role(-1)
    with pytest.raises(TypeError, match="layer_id"):
        V41_FLASH.layer_role("3")
    with pytest.raises(TypeError, match="layer_id"):
        V41_FLASH.layer_role(True)
    assert len(V41_FLASH.layer_roles()) == 43


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_round_trip_presets(name):
    cfg = PRESETS[name]
    d = cfg.to_hf_config()
    assert DeepseekV4AttentionConfig.from_hf_config(d) == cfg
    # through JSON, as a config.json would be
    assert DeepseekV4AttentionConfig.from_hf_config(json.loads(json.dumps(d))) == cfg


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_round_trip_presets_composite(name):
    cfg = PRESETS[name]
    d = cfg.to_hf_config(composite=True)
    assert set(d) == {"text_config"} and d["text_config"] == cfg.to_hf_config()
    assert DeepseekV4AttentionConfig.from_hf_config(d) == cfg
    assert DeepseekV4AttentionConfig.from_hf_config(json.loads(json.dumps(d))) == cfg


def hf_composite_dict():
    """A V4.1 config.json in Hugging Face's composite form: the text model's fields under `text_config`,
    with the keys such a file carries that the attention config has no use for."""
    text = v41_flash_dict()
    del text["dsv4_version"]
    text.update(model_type="deepseek_v4_text", torch_dtype="bfloat16", hidden_act="silu")
    text["rope_scaling"] = {**text["rope_scaling"], "mscale": 1.0, "mscale_all_dim": 1.0}
    return {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "text_config": text,
            "transformers_version": "4.99.0"}


def test_composite_config_reads_text_config_and_reports_keys():
    d = hf_composite_dict()
    cfg, keys = DeepseekV4AttentionConfig.from_hf_config_with_keys(d)
    assert cfg == V41_FLASH
    assert keys.composite and keys.source == "dict"
    assert "text_config.num_hidden_layers" in keys.used and "text_config.rope_scaling" in keys.used
    assert keys.ignored == ("architectures", "model_type", "transformers_version", "text_config.hidden_act",
                            "text_config.model_type", "text_config.rope_scaling.mscale",
                            "text_config.rope_scaling.mscale_all_dim", "text_config.torch_dtype")
    assert not set(keys.used) & set(keys.ignored)
    flat, flat_keys = DeepseekV4AttentionConfig.from_hf_config_with_keys(d["text_config"])
    assert flat == cfg and not flat_keys.composite
    assert flat_keys.used == tuple(k.removeprefix("text_config.") for k in keys.used)
    assert "model_type" in flat_keys.ignored and "architectures" not in flat_keys.ignored


def test_config_from_path_and_object(tmp_path, caplog):
    d = hf_composite_dict()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(d))
    with caplog.at_level("INFO", logger="dsv41_jax.config"):
        assert DeepseekV4AttentionConfig.from_hf_config(path) == V41_FLASH  # os.PathLike
    assert "ignored 8 keys" in caplog.text and "text_config.rope_scaling.mscale" in caplog.text
    assert DeepseekV4AttentionConfig.from_hf_config(str(path)) == V41_FLASH
    cfg, keys = DeepseekV4AttentionConfig.from_hf_config_with_keys(str(tmp_path))  # the directory holding it
    assert cfg == V41_FLASH and keys.source == str(tmp_path)

    class FakeTransformersConfig:  # what transformers.PretrainedConfig offers: to_dict()
        def to_dict(self):
            return copy.deepcopy(d)

    assert DeepseekV4AttentionConfig.from_hf_config(FakeTransformersConfig()) == V41_FLASH
    with pytest.raises(ValueError, match="does not exist"):
        DeepseekV4AttentionConfig.from_hf_config(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json.*not valid JSON"):
        DeepseekV4AttentionConfig.from_hf_config(tmp_path / "bad.json")
    with pytest.raises(TypeError, match="'text_config' must be a mapping"):
        DeepseekV4AttentionConfig.from_hf_config({"text_config": 3})
    with pytest.raises(ValueError, match="missing required key 'num_hidden_layers'"):
        DeepseekV4AttentionConfig.from_hf_config({"text_config": {}, "num_hidden_layers": 40})


def test_nested_rope_scaling_reports_the_unused_main_entry():
    d = tiny_dict()
    d["rope_scaling"] = {"main": {"type": "default"}, "compress": dict(d["rope_scaling"], mscale=0.7)}
    _, keys = DeepseekV4AttentionConfig.from_hf_config_with_keys(d)
    assert keys.ignored == ("rope_scaling.compress.mscale", "rope_scaling.main")


def test_from_hf_matches_raw_dict():
    d = v41_flash_dict()
    cfg = DeepseekV4AttentionConfig.from_hf_config(copy.deepcopy(d))
    assert cfg == V41_FLASH
    for k in ("hidden_size", "num_hidden_layers", "q_lora_rank", "index_topk", "sliding_window"):
        assert getattr(cfg, k) == d[k]


def test_version_detection():
    d = tiny_dict()
    del d["dsv4_version"]
    assert DeepseekV4AttentionConfig.from_hf_config(d).version == "v4.1"
    d40 = V4_FLASH.to_hf_config()
    del d40["dsv4_version"]
    del d40["kv_source_layer_ids"]
    del d40["index_source_layer_ids"]
    assert DeepseekV4AttentionConfig.from_hf_config(d40).version == "v4.0"
    assert DeepseekV4AttentionConfig.from_hf_config(d40) == V4_FLASH


def test_nested_rope_scaling():
    d = tiny_dict()
    yarn = dict(d["rope_scaling"])
    d["rope_scaling"] = {"main": {"type": "default"}, "compress": yarn}
    cfg = DeepseekV4AttentionConfig.from_hf_config(d)
    assert cfg.rope_scaling.factor == 4.0 and cfg.rope_scaling.original_max_position_embeddings == 64
    d["rope_scaling"] = None
    cfg = DeepseekV4AttentionConfig.from_hf_config(d)
    assert not cfg.rope_scaling.enabled and not cfg.layer_role(1).use_yarn
    assert DeepseekV4AttentionConfig.from_hf_config(cfg.to_hf_config()) == cfg


@st.composite
def v41_dicts(draw):
    n_hidden = draw(st.integers(2, 24))
    n_mtp = draw(st.integers(0, 3))
    n_list = draw(st.integers(0, n_hidden + n_mtp))
    ratios = draw(st.lists(st.sampled_from([0, 0, 1, 2]), min_size=n_list, max_size=n_list))
    kv, idx = [], []
    current = None  # ratio of the latest kv source
    for i, r in enumerate(ratios):
        if r == 0:
            continue
        if current != r or draw(st.integers(0, 5)) == 0:
            kv.append(i)
            current = r
        if not idx or draw(st.integers(0, 2)) == 0:
            idx.append(i)
    cand = draw(st.sampled_from(idx)) if idx and draw(st.booleans()) else None
    d = tiny_dict()
    d.update(num_hidden_layers=n_hidden, num_nextn_predict_layers=n_mtp, compress_ratios=ratios,
             kv_source_layer_ids=kv, index_source_layer_ids=idx, candidate_source_layer_id=cand,
             candidate_topk_blocks=draw(st.integers(1, 64)) if cand is not None else 0)
    return d


@settings(max_examples=60, deadline=None)
@given(v41_dicts())
def test_random_v41_topologies(d):
    cfg = DeepseekV4AttentionConfig.from_hf_config(d)
    assert cfg.num_layers == d["num_hidden_layers"] + d["num_nextn_predict_layers"]
    for layer in range(cfg.num_layers):
        role = cfg.layer_role(layer)
        for k, v in role_oracle(d, layer).items():
            assert getattr(role, k) == v, (layer, k)
        if role.has_compressed_cache:
            # the cache it reads has its own ratio
            assert cfg.compress_ratios[role.kv_source_layer] == role.compress_ratio
            assert role.rope_theta == cfg.compress_rope_theta
        else:
            assert role.rope_theta == cfg.rope_theta and not role.use_yarn
    assert DeepseekV4AttentionConfig.from_hf_config(cfg.to_hf_config()) == cfg


# ---------------------------------------------------------------------------- validation
REQUIRED = ["num_hidden_layers", "hidden_size", "num_attention_heads", "q_lora_rank", "o_lora_rank",
            "o_groups", "sliding_window", "index_topk", "index_n_heads", "index_head_dim"]


@pytest.mark.parametrize("key", REQUIRED)
def test_missing_required_key(key):
    d = tiny_dict()
    del d[key]
    with pytest.raises(ValueError, match=key):
        DeepseekV4AttentionConfig.from_hf_config(d)


def _set(**kv):
    def f(d):
        d.update(kv)
    return f


def _set_rope(**kv):
    def f(d):
        d["rope_scaling"] = {**d["rope_scaling"], **kv}
    return f


BAD = [
    # (id, mutation, exception, key that the message must name)
    ("hidden_size str", _set(hidden_size="128"), TypeError, "hidden_size"),
    ("hidden_size bool", _set(hidden_size=True), TypeError, "hidden_size"),
    ("hidden_size float", _set(hidden_size=128.0), TypeError, "hidden_size"),
    ("num_hidden_layers None", _set(num_hidden_layers=None), TypeError, "num_hidden_layers"),
    ("index_topk list", _set(index_topk=[6]), TypeError, "index_topk"),
    ("rope_theta str", _set(rope_theta="1e4"), TypeError, "rope_theta"),
    ("rms_norm_eps str", _set(rms_norm_eps="tiny"), TypeError, "rms_norm_eps"),
    ("compress_ratios str", _set(compress_ratios="0,2"), TypeError, "compress_ratios"),
    ("compress_ratios float", _set(compress_ratios=[0, 2, 2, 1.0, 1, 1, 0]), TypeError, "compress_ratios"),
    ("kv sources str entry", _set(kv_source_layer_ids=[1, "3"]), TypeError, "kv_source_layer_ids"),
    ("index sources not list", _set(index_source_layer_ids=5), TypeError, "index_source_layer_ids"),
    ("candidate str", _set(candidate_source_layer_id="3"), TypeError, "candidate_source_layer_id"),
    ("rope_scaling str", _set(rope_scaling="yarn"), TypeError, "rope_scaling"),
    ("rope_scaling factor str", _set_rope(factor="4"), TypeError, "rope_scaling.factor"),
    ("ratio 3 in V4.1", _set(compress_ratios=[0, 2, 2, 3, 1, 1, 0]), ValueError, "compress_ratios"),
    ("ratio 4 in V4.1", _set(compress_ratios=[0, 2, 2, 4, 1, 1, 0]), ValueError, "compress_ratios"),
    ("too many ratios", _set(compress_ratios=[0] * 9), ValueError, "compress_ratios"),
    ("version", _set(dsv4_version="v5"), ValueError, "dsv4_version"),
    ("hidden_size 0", _set(hidden_size=0), ValueError, "hidden_size"),
    ("sliding_window negative", _set(sliding_window=-8), ValueError, "sliding_window"),
    ("index_topk 0", _set(index_topk=0), ValueError, "index_topk"),
    ("rope_theta 0", _set(rope_theta=0.0), ValueError, "rope_theta"),
    ("head_dim 576", _set(head_dim=576), ValueError, "head_dim"),
    ("rope dim 32", _set(qk_rope_head_dim=32), ValueError, "qk_rope_head_dim"),
    ("o_groups", _set(o_groups=3), ValueError, "o_groups"),
    ("index_head_dim odd", _set(index_head_dim=65), ValueError, "index_head_dim"),
    ("index_head_dim small", _set(index_head_dim=32), ValueError, "index_head_dim"),
    ("candidate_topk_blocks negative", _set(candidate_topk_blocks=-1), ValueError, "candidate_topk_blocks"),
    ("candidate_block_size 0", _set(candidate_block_size=0), ValueError, "candidate_block_size"),
    ("mtp negative", _set(num_nextn_predict_layers=-1, compress_ratios=[0, 2, 2, 1, 1, 1]), ValueError,
     "num_nextn_predict_layers"),
    ("kv source ratio mismatch", _set(kv_source_layer_ids=[1]), ValueError, "kv_source_layer_ids"),
    ("kv source ratio mismatch 2", _set(kv_source_layer_ids=[1, 2, 4], index_source_layer_ids=[1, 3]),
     ValueError, "kv_source_layer_ids"),
    ("kv sources unsorted", _set(kv_source_layer_ids=[3, 1]), ValueError, "kv_source_layer_ids"),
    ("kv sources duplicate", _set(kv_source_layer_ids=[1, 1, 3]), ValueError, "kv_source_layer_ids"),
    ("kv source on swa layer", _set(kv_source_layer_ids=[0, 1, 3]), ValueError, "kv_source_layer_ids"),
    ("kv source out of range", _set(kv_source_layer_ids=[1, 3, 99]), ValueError, "kv_source_layer_ids"),
    ("kv source negative", _set(kv_source_layer_ids=[-1, 1, 3]), ValueError, "kv_source_layer_ids"),
    ("compressed layer without kv source", _set(kv_source_layer_ids=[3]), ValueError, "kv_source_layer_ids"),
    ("no kv sources at all", _set(kv_source_layer_ids=[]), ValueError, "kv_source_layer_ids"),
    ("compressed layer without index source", _set(index_source_layer_ids=[3, 5], candidate_source_layer_id=None),
     ValueError, "index_source_layer_ids"),
    ("index source on swa layer", _set(index_source_layer_ids=[0, 1, 3]), ValueError, "index_source_layer_ids"),
    ("candidate not an index source", _set(candidate_source_layer_id=4), ValueError, "candidate_source_layer_id"),
    ("candidate without blocks", _set(candidate_topk_blocks=0), ValueError, "candidate_topk_blocks"),
    ("v4.0 with kv sources", _set(dsv4_version="v4.0", compress_ratios=[0, 4, 128, 4, 128, 4, 0],
                                  candidate_source_layer_id=None), ValueError, "kv_source_layer_ids"),
    ("v4.0 ratio 2", _set(dsv4_version="v4.0", compress_ratios=[0, 4, 2], kv_source_layer_ids=[],
                          index_source_layer_ids=[], candidate_source_layer_id=None), ValueError, "compress_ratios"),
    ("rope_scaling type", _set_rope(type="linear"), ValueError, "rope_scaling.type"),
    ("rope_scaling factor < 1", _set_rope(factor=0.5), ValueError, "rope_scaling.factor"),
    ("rope_scaling factor inf", _set_rope(factor=float("inf")), ValueError, "rope_scaling.factor"),
]


@pytest.mark.parametrize("mutate,exc,key", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_validation_errors_name_the_key(mutate, exc, key):
    d = tiny_dict()
    mutate(d)
    with pytest.raises(exc) as e:
        DeepseekV4AttentionConfig.from_hf_config(d)
    assert key in str(e.value), str(e.value)


def test_config_must_be_a_mapping():
    with pytest.raises(TypeError, match="mapping, a path to a config.json or an object with to_dict"):
        DeepseekV4AttentionConfig.from_hf_config([("hidden_size", 1)])


def test_int_accepted_for_float_keys():
    d = tiny_dict()
    d["rope_theta"] = 10000
    cfg = DeepseekV4AttentionConfig.from_hf_config(d)
    assert cfg.rope_theta == 10000.0 and isinstance(cfg.rope_theta, float)


def test_replace_validates():
    assert V41_FLASH.replace(sliding_window=64).sliding_window == 64
    with pytest.raises(ValueError, match="sliding_window"):
        V41_FLASH.replace(sliding_window=0)
    with pytest.raises(ValueError, match="compress_ratios"):
        V41_FLASH.replace(compress_ratios=(0,) * 42 + (3,))


def test_composite_config_errors_say_the_keys_are_under_text_config():
    with pytest.raises(ValueError, match=r"in text_config of the composite config: config is missing required key "
                                         r"'num_hidden_layers'"):
        DeepseekV4AttentionConfig.from_hf_config({"architectures": ["X"], "text_config": {"hidden_size": 8}})
    hf = V41_FLASH.to_hf_config()
    hf["hidden_size"] = "big"
    with pytest.raises(TypeError, match=r"in text_config of the composite config: config key 'hidden_size' must be int"):
        DeepseekV4AttentionConfig.from_hf_config({"text_config": hf})
    with pytest.raises(TypeError, match=r"^config key 'hidden_size' must be int"):  # the flat form: no prefix
        DeepseekV4AttentionConfig.from_hf_config(hf)
