"""Parameter counts (lifecycle.tasks.train.sizing.param_count): exact against the model the trainer builds, and
against the published totals of real checkpoints, read from their config.json as `train.init_from: hf:` does."""

import json

import pytest

from lifecycle.core.errors import UsageError
from lifecycle.tasks.train.config import ModelConfig, MoEArch
from lifecycle.tasks.train.hf_config import model_fields
from lifecycle.tasks.train.planner import Layout, parse_model, total_params
from lifecycle.tasks.train.step_time import Hardware, step_time
from lifecycle.tasks.train.sizing import flops_per_token, non_embedding_params, param_count, tensors

TINY = dict(vocab_size=96, n_layer=3, n_head=4, n_embd=32, seq_len=16)
SHAPES = [
    {},
    {"n_kv_head": 2},  # grouped-query attention: k and v are 32·16 each
    {"n_kv_head": 1, "qkv_bias": True, "tie_embeddings": False},
    {"mlp_hidden_dim": 40, "n_kv_head": 2},
    {"mlp": "gelu", "norm": "layernorm", "pos": "learned"},
    {"mlp": "gelu", "pos": "learned", "tie_embeddings": False, "qkv_bias": True},
    {"moe": MoEArch(num_experts=4, top_k=2)},
    {"moe": MoEArch(num_experts=3, top_k=1, every=2), "n_kv_head": 2, "tie_embeddings": False},
]


@pytest.mark.parametrize("kw", SHAPES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_counts_equal_the_model_the_trainer_builds(kw):
    from lifecycle.tasks.train.model import GPT

    cfg = ModelConfig(**{**TINY, **kw})
    model = GPT(cfg)
    count = param_count(cfg)
    assert tensors(cfg) == {name: p.numel() for name, p in model.named_parameters()}  # tensor by tensor
    assert count.total == sum(p.numel() for p in model.parameters())  # parameters() yields a tied matrix once
    assert count.non_embedding == non_embedding_params(cfg) == model.num_params(exclude_embeddings=True)
    assert flops_per_token(cfg) == model.flops_per_token()  # MoE: top_k experts, as the model counts them
    assert total_params(cfg) == count.total


def test_gqa_narrows_k_and_v_only():
    mha = ModelConfig(**TINY)
    gqa = ModelConfig(**TINY, n_kv_head=1)  # head_dim 8: k and v shrink from 32x32 to 32x8 each
    assert param_count(mha).total - param_count(gqa).total == 3 * 2 * 32 * (32 - 8)


# config.json of each checkpoint, the fields that decide the count written out as published on the Hugging Face
# Hub (meta-llama/Llama-2-7b-hf, meta-llama/Llama-3.1-8B, mistralai/Mistral-7B-v0.1, Qwen/Qwen2-7B,
# Qwen/Qwen2.5-0.5B), and the total parameters each checkpoint holds.
LLAMA2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": 4096,
             "intermediate_size": 11008, "max_position_embeddings": 4096, "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-05, "rope_scaling": None,
             "tie_word_embeddings": False, "vocab_size": 32000}
LLAMA31_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "mlp_bias": False,
              "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 131072,
              "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192, "rope_type": "llama3"},
              "rope_theta": 500000.0, "tie_word_embeddings": False, "vocab_size": 128256}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_act": "silu",
              "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
              "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
              "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False, "vocab_size": 32000}
QWEN2_7B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 3584,
            "intermediate_size": 18944, "max_position_embeddings": 131072, "num_attention_heads": 28,
            "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
            "sliding_window": 131072, "use_sliding_window": False, "tie_word_embeddings": False, "vocab_size": 152064}
QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
              "intermediate_size": 4864, "max_position_embeddings": 32768, "num_attention_heads": 14,
              "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
              "sliding_window": 32768, "use_sliding_window": False, "tie_word_embeddings": True, "vocab_size": 151936}

# By hand: a block is 2 norms (2d) + q, o (d·d each) + k, v (d·kv each, kv = n_kv_head·head_dim) + q/k/v biases
# (Qwen2: d + 2kv) + SwiGLU 3·d·ffn; the total is L blocks + the final norm d + the token table V·d + the head V·d
# (once if tied).
# Llama 2 7B:   2·4096 + 2·4096² + 2·4096·4096 + 3·4096·11008 = 202,383,360; ×32 = 6,476,267,520;
#               + 4,096 + 2·32,000·4,096 (262,144,000) = 6,738,415,616
# Llama 3.1 8B: 8,192 + 33,554,432 + 2·4096·1024 (8,388,608) + 3·4096·14336 (176,160,768) = 218,112,000; ×32 =
#               6,979,584,000; + 4,096 + 2·128,256·4,096 (1,050,673,152) = 8,030,261,248
# Mistral 7B:   the same blocks as Llama 3.1 8B (6,979,584,000) + 4,096 + 262,144,000 = 7,241,732,096
# Qwen2 7B:     7,168 + 2·3584² (25,690,112) + 2·3584·512 (3,670,016) + bias 3584 + 2·512 (4,608)
#               + 3·3584·18944 (203,685,888) = 233,057,792; ×28 = 6,525,618,176; + 3,584 + 2·152,064·3,584
#               (1,089,994,752) = 7,615,616,512
# Qwen2.5 0.5B: 1,792 + 2·896² (1,605,632) + 2·896·128 (229,376) + 1,152 + 3·896·4864 (13,074,432) = 14,912,384;
#               ×24 = 357,897,216; + 896 + 151,936·896 (136,134,656, tied: once) = 494,032,768
PUBLISHED = [("llama2-7b", LLAMA2_7B, 6_738_415_616), ("llama3.1-8b", LLAMA31_8B, 8_030_261_248),
             ("mistral-7b", MISTRAL_7B, 7_241_732_096), ("qwen2-7b", QWEN2_7B, 7_615_616_512),
             (None, QWEN25_05B, 494_032_768)]


def checkpoint_dir(tmp_path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize("preset,config,published", PUBLISHED, ids=[str(p[2]) for p in PUBLISHED])
def test_published_totals_from_config_json(tmp_path, preset, config, published):
    cfg = ModelConfig(**model_fields(checkpoint_dir(tmp_path, config), seq_len=4096))
    assert param_count(cfg).total == published
    # the planner reads the same directory (`--model hf:DIR`), and its preset of that name is the same model
    assert total_params(parse_model(f"hf:{tmp_path}")) == published
    if preset:
        assert total_params(parse_model(preset)) == published


def test_mixtral_total_and_active():
    """Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json: the Mistral 7B shape, 8 experts, top 2; hf_config
    does not read model_type mixtral, so the fields are written here). A block: 8,192 norms + 41,943,040
    attention + router 4,096·8 = 32,768 + 8 experts of 176,160,768 = 1,451,270,144; ×32 + 4,096 + 262,144,000 =
    46,702,792,704. Active: 2 experts, 394,305,536 a block; ×32 + 4,096 + 131,072,000 (head; the token table is
    a lookup) = 12,748,853,248, which with the table (131,072,000) is the 12.9B active of the Mixtral paper."""
    m = parse_model("mistral-7b").model_copy(update={"moe": MoEArch(num_experts=8, top_k=2)})
    count = param_count(m)
    assert count.total == 46_702_792_704
    assert count.active == 12_748_853_248 and count.active + 32000 * 4096 == 12_879_925_248
    assert flops_per_token(m, 4096) == 6 * count.active + 12 * 32 * 4096 * 4096


def test_step_time_and_mfu_use_the_active_count():
    m = parse_model("llama3.1-8b")
    hw = Hardware(mfu=0.45)
    t = step_time(m, Layout(dp=8, zero=1), 64, hw)
    tokens = 64 * 8192
    assert t["compute_s"] * 8 * hw.peak_flops * hw.mfu == pytest.approx(
        tokens * (6 * param_count(m).active + 12 * 32 * 4096 * 8192), rel=1e-4)


def test_hf_dir_errors_name_the_field(tmp_path):
    with pytest.raises(UsageError, match="attention_bias=True"):
        parse_model(f"hf:{checkpoint_dir(tmp_path, {**LLAMA2_7B, 'attention_bias': True})}")
    assert parse_model(f"hf:{checkpoint_dir(tmp_path, LLAMA2_7B)},seq_len=2048").seq_len == 2048
