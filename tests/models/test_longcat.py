"""LongCat-Flash from Hugging Face: its config.json read and written, its tensor names, and what
transformers does not run rejected with the reason."""

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from models.checkpoints import load_config
from models.checkpoints.names import hf_name_map, longcat_skipped
from models.config import Architecture, read_hf_config, write_hf_config

GOLDEN = Path(__file__).parents[1] / "golden" / "longcat_flash"
HF_CONFIG = json.loads((GOLDEN / "config.json").read_text())


def test_config_from_hf():
    """The golden config: 2 LongCat layers, MLA with LongCat's LoRA scales over interleaved
    RoPE pairs, 8 routed + 4 zero-computation experts under the softmax router with a
    correction bias, scaled by 6 and not renormalized; written back, it reads the same."""
    config = read_hf_config(HF_CONFIG)
    assert config.architecture is Architecture.LONGCAT_FLASH
    assert (config.num_layers, config.intermediate_size, config.head_dim) == (2, 32, 16)
    mla = config.mla
    assert mla.lora_scaled and mla.rope_interleaved and mla.q_lora_rank == 24
    assert mla.q_lora_scale == pytest.approx((32 / 24) ** 0.5)
    assert mla.kv_lora_scale == pytest.approx((32 / 16) ** 0.5)
    moe = config.moe
    assert (moe.num_experts, moe.zero_experts, moe.top_k, moe.expert_intermediate_size) == (
        8,
        4,
        3,
        8,
    )
    rule = moe.routing
    assert rule.correction_bias and not rule.renormalize and rule.scaling_factor == 6.0
    assert rule.total_experts == 12 and moe.mlp_only_layers == ()
    assert config.sparse_layers == (True, True)
    assert read_hf_config(write_hf_config(config)) == config
    legacy = {k: v for k, v in HF_CONFIG.items() if k != "num_layers"} | {"num_hidden_layers": 4}
    assert read_hf_config(legacy) == config  # transformers' num_hidden_layers is 2 x layers


@pytest.mark.parametrize(
    "change,match",
    [
        ({"router_bias": True}, "router_bias"),
        ({"zero_expert_type": "zero"}, "zero_expert_type"),
        ({"mla_scale_q_lora": False}, "mla_scale_q_lora"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"head_dim": 16}, "head_dim"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"model_type": "deepseek_v3"}, "model_type"),
    ],
)
def test_config_rejects_what_transformers_does_not_run(change, match):
    """Each option transformers computes otherwise (or that LongCat's own code reads another
    way) fails when the config is read, naming the key."""
    with pytest.raises(ValueError, match=match):
        read_hf_config(HF_CONFIG | change)


def test_name_map_reads_every_tensor_but_the_unread_ones():
    """Every parameter has a checkpoint tensor, and every tensor is read except the weights
    `save_pretrained` writes for the zero-computation experts (and a multi-token-prediction
    head), which the loader skips."""
    config = load_config(GOLDEN)
    names = hf_name_map(config)
    used = {name for tensor in names.values() for name in tensor.tensor_names()}
    with safe_open(GOLDEN / "model.safetensors", "np") as file:
        stored = set(file.keys())
    assert used <= stored
    unread = stored - used
    assert unread and all(longcat_skipped(name, config) for name in unread)
    assert {int(name.split(".")[5]) for name in unread} == {8, 9, 10, 11}
    assert longcat_skipped("model.mtp.layers.0.eh_proj.weight", config)
    assert not longcat_skipped("model.layers.0.mlp.experts.7.gate_proj.weight", config)
    assert names["layers.1.attn_1.kv_a_layernorm.weight"].name == (
        "model.layers.1.self_attn.1.kv_a_layernorm.weight"
    )
    assert names["layers.0.mlp.router"].name == "model.layers.0.mlp.router.classifier.weight"
    assert names["layers.0.mlps_1.gate_up_proj.kernel"].tensor_names() == (
        "model.layers.0.mlps.1.gate_proj.weight",
        "model.layers.0.mlps.1.up_proj.weight",
    )
    with pytest.raises(NotImplementedError, match="scan_layers"):
        hf_name_map(config, scan_layers=True)
