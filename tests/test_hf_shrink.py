"""The HuggingFace config shrinker (``torchalpa/suite/hf_shrink.py``) on config dicts:
the shrunk configs must stay self-consistent, or the sweep blames the wrong party."""
from torchalpa.suite.hf_shrink import LAYERS, shrink


def test_jamba_keeps_an_attention_layer():
    # Jamba's default: attention at layers 4, 12, ... (period 8); two kept layers had none,
    # and the hybrid cache then refused to report a sequence length.
    d = {"num_hidden_layers": 32, "attn_layer_period": 8, "attn_layer_offset": 4}
    out = shrink(d)
    kinds = ["attention" if i % out["attn_layer_period"] == out["attn_layer_offset"]
             else "mamba" for i in range(out["num_hidden_layers"])]
    assert "attention" in kinds and "mamba" in kinds


def test_mla_query_head_is_its_two_parts():
    # LongCat-Flash splits queries of qk_head_dim into nope + rope parts.
    d = {"num_layers": 28, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
         "qk_head_dim": 192}
    out = shrink(d)
    assert out["qk_head_dim"] == out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    assert out["qk_head_dim"] < 192


def test_group_norm_groups_divide_the_narrowed_bottlenecks():
    # BiT: GroupNorm(32, ...) over stages shrunk to 16 * 2**i channels, bottlenecks a quarter
    # of that; 32 groups divided none of them and the model did not build.
    d = {"hidden_sizes": [256, 512, 1024, 2048], "depths": [3, 4, 6, 3], "num_groups": 32,
         "embedding_size": 64}
    out = shrink(d, "bit")
    widths = [out["embedding_size"]] + [w // 4 for w in out["hidden_sizes"]]
    assert all(w % out["num_groups"] == 0 for w in widths), (out, widths)


def test_block_pattern_keeps_every_kind():
    # RecurrentGemma cycles block_types over its layers.
    d = {"num_hidden_layers": 26, "block_types": ["recurrent", "recurrent", "attention"]}
    out = shrink(d)
    assert out["num_hidden_layers"] == LAYERS
    assert set(out["block_types"]) == {"recurrent", "attention"}


def test_hybrid_layer_ids_follow_the_kept_layers():
    # Zamba2: layers_block_type marks the hybrid layers and hybrid_layer_ids lists them.
    types = ["mamba"] * 6 + ["hybrid"] + ["mamba"] * 5
    d = {"num_hidden_layers": 12, "layers_block_type": types, "hybrid_layer_ids": [6]}
    out = shrink(d)
    assert out["layers_block_type"] == ["mamba", "hybrid"]
    assert out["hybrid_layer_ids"] == [1]


def test_a_missing_package_is_not_blamed_on_the_config():
    """DiNAT needs natten: the sweep must see the ImportError (and say 'needs natten'),
    not 'default config does not build'."""
    import importlib.util
    import sys

    import pytest
    if importlib.util.find_spec("natten") is not None:
        pytest.skip("natten is installed")
    from torchalpa.suite.hf_shrink import build_model
    with pytest.raises(ImportError) as info:
        build_model("imgcls", "dinat", "DinatForImageClassification")
    sys.path.insert(0, "benchmarks")
    try:
        import hf_sweep
    finally:
        sys.path.remove("benchmarks")
    row = {"stage": "none", "error": f"ImportError: {hf_sweep._first_line(info.value)}"}
    assert hf_sweep.classify(row) == "needs natten"
