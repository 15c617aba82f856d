"""`train.init_from: hf:<dir>`: tiny random checkpoints of each family, built offline with transformers from a
config, import into our model with the same logits, export back bit for bit, and bad input is refused."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from bench.hf_import import FAMILIES, make_tiny
from lifecycle.tasks.eval.export import hf_architecture, llama_config, to_llama_state
from lifecycle.tasks.train import hf_import
from lifecycle.tasks.train.config import ModelConfig, TrainConfig
from lifecycle.tasks.train.hf_import import HFImportError, load_hf, model_config
from lifecycle.tasks.train.model import GPT

SHARDED = {"llama3": "60KB", "qwen2": "60KB"}  # these two saved sharded with an index, the rest single-file


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {f: make_tiny(root / f, f, shard_size=SHARDED.get(f)) for f in FAMILIES}


def hf_logits(directory: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=ids).logits


def files_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out |= load_file(str(f))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(tiny, family):
    d = tiny[family]
    assert (d / hf_import.INDEX).is_file() == (family in SHARDED)
    ours = load_hf(d, seq_len=64)
    ids = torch.randint(0, 320, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, _ = ours(ids)
    diff = (a - hf_logits(d, ids)).abs().max().item()
    print(f"{family}: max abs logit diff {diff:.3g}")
    assert diff <= 1e-4
    cfg = ours.cfg
    assert cfg.tie_embeddings == (family in ("qwen2", "smollm"))
    assert cfg.qkv_bias == (family == "qwen2")
    assert (cfg.rope_scaling is not None) == (family == "llama3")
    assert cfg.kv_heads < cfg.n_head or family == "llama2"


@pytest.mark.parametrize("family", FAMILIES)
def test_import_export_round_trip_is_bit_identical(tiny, family, tmp_path):
    from safetensors.torch import save_file
    from transformers import LlamaConfig, Qwen2Config

    d = tiny[family]
    model = load_hf(d, seq_len=64)
    exported = to_llama_state(model.export_state(), model.cfg)
    original = files_tensors(d)
    assert exported.keys() == original.keys()
    for k, t in original.items():
        assert torch.equal(exported[k], t), k
    # and the exported config computes the same model in transformers
    arch = hf_architecture(model.cfg)
    conf = (Qwen2Config if arch == "Qwen2ForCausalLM" else LlamaConfig)(**llama_config(model.cfg, 2, None, 1))
    conf.architectures = [arch]
    conf.save_pretrained(str(tmp_path))
    save_file(exported, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.randint(0, 320, (1, 64), generator=torch.Generator().manual_seed(2))
    assert (hf_logits(tmp_path, ids) - hf_logits(d, ids)).abs().max().item() <= 1e-5
    # and the export's config imports back to the same ModelConfig
    assert model_config(tmp_path, 64) == model.cfg


def test_transformers_4x_config_reads_the_same(tiny, tmp_path):
    """4.x wrote rope_theta and rope_scaling at the top level; 5.x writes rope_parameters."""
    d = tiny["llama3"]
    cfg = json.loads((d / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    old = {**cfg, "rope_theta": params.pop("rope_theta"), "rope_scaling": {**params, "type": params.pop("rope_type")}}
    shutil.copytree(d, tmp_path / "old")
    (tmp_path / "old" / "config.json").write_text(json.dumps(old))
    assert model_config(tmp_path / "old", 64) == model_config(d, 64)
    assert model_config(d, 64).rope_scaling.factor == 8.0


def test_default_model_keeps_its_state_dict_keys():
    m = GPT(ModelConfig(vocab_size=64))
    keys = set(m.state_dict())
    assert {"blocks.0.attn.qkv.weight", "wte.weight", "lm_head.weight"} <= keys
    assert not any(k.endswith(".bias") for k in keys)
    assert m.blocks[0].attn.qkv.weight.shape == (3 * 128, 128)
    assert ModelConfig().model_dump(exclude={"n_kv_head", "qkv_bias", "mlp_hidden_dim", "rope_scaling"}) == \
        ModelConfig.model_validate_json(json.dumps(ModelConfig().model_dump(
            exclude={"n_kv_head", "qkv_bias", "mlp_hidden_dim", "rope_scaling"}))).model_dump(
            exclude={"n_kv_head", "qkv_bias", "mlp_hidden_dim", "rope_scaling"})


# ---------------------------------------------------------------------------------------------------- refusals


def edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("change, words", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_parameters.rope_type='yarn'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}, "model_type='gpt2'"),
    ({"attention_bias": True}, "attention_bias=True"),
])
def test_unsupported_config_is_refused_at_config_build(tiny, tmp_path, change, words):
    d = edit_config(tiny["llama2"], tmp_path / "m", **change)
    with pytest.raises(ValueError) as e:
        TrainConfig(init_from=f"hf:{d}", model={"seq_len": 64})
    assert words in str(e.value) and "config.json" in str(e.value)


@pytest.mark.parametrize("change, words", [
    ({"num_hidden_layers": 1_000_000}, "more than this host's"),  # would allocate until the kernel kills the ranks
    ({"hidden_size": None}, "hidden_size=None"),  # was KeyError, an internal error
    ({"num_attention_heads": 0}, "num_attention_heads=0"),  # was ZeroDivisionError
    ({"vocab_size": "32000"}, "vocab_size='32000'"),
])
def test_a_hostile_or_broken_config_is_refused_at_config_build_naming_the_field(tiny, tmp_path, change, words):
    """Issue 44, 3: refused with the file and the field, before any rank starts."""
    d = edit_config(tiny["llama2"], tmp_path / "m", **change)
    with pytest.raises(ValueError) as e:
        TrainConfig(init_from=f"hf:{d}", model={"seq_len": 64})
    assert words in str(e.value) and "config.json" in str(e.value)


def test_symlinks_and_paths_out_of_the_checkpoint_are_refused(tiny, tmp_path):
    """Issue 44, 3: `generation_config.json -> /etc/shadow` was hashed into the run's config and MLflow, and an index
    entry "/etc/shadow" was opened by the ranks."""
    d = shutil.copytree(tiny["llama3"], tmp_path / "m")
    (tmp_path / "secret").write_text("not for the run")
    (d / "generation_config.json").unlink(missing_ok=True)
    (d / "generation_config.json").symlink_to(tmp_path / "secret")
    with pytest.raises(ValueError, match="'generation_config.json' lies outside the checkpoint directory"):
        TrainConfig(init_from=f"hf:{d}", model={"seq_len": 64})
    (d / "generation_config.json").unlink()
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = str(tmp_path / "secret")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="lies outside the checkpoint directory"):
        TrainConfig(init_from=f"hf:{d}", model={"seq_len": 64})


def test_sliding_window_shorter_than_seq_len_is_refused(tiny, tmp_path):
    d = edit_config(tiny["mistral"], tmp_path / "m", sliding_window=32)
    with pytest.raises(HFImportError, match="sliding_window=32"):
        model_config(d, 64)
    assert model_config(d, 32).n_layer == 2  # a window as long as the context is full attention


def test_train_config_takes_the_architecture_from_the_checkpoint(tiny):
    cfg = TrainConfig(init_from=f"hf:{tiny['llama3']}", model={"seq_len": 64, "dropout": 0.1})
    assert cfg.model.n_kv_head == 2 and cfg.model.seq_len == 64 and cfg.model.dropout == 0.1
    with pytest.raises(ValueError, match="train.model.n_layer=8"):
        TrainConfig(init_from=f"hf:{tiny['llama3']}", model={"seq_len": 64, "n_layer": 8})


def test_missing_shard_names_the_file(tiny, tmp_path):
    d = shutil.copytree(tiny["llama3"], tmp_path / "m")
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(HFImportError, match=f"{shard.name}: shard listed in .*missing"):
        load_hf(d, 64)
    with pytest.raises(ValueError, match=shard.name):
        TrainConfig(init_from=f"hf:{d}", model={"seq_len": 64})


def test_shard_not_matching_the_index_names_the_file_and_loads_nothing(tiny, tmp_path):
    d = shutil.copytree(tiny["llama3"], tmp_path / "m")
    index = json.loads((d / hf_import.INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    moved = next(k for k, v in index["weight_map"].items() if v == shards[-1])
    index["weight_map"][moved] = shards[0]  # the index says shard 0 holds it; shard 0 does not
    (d / hf_import.INDEX).write_text(json.dumps(index))
    model = GPT(model_config(d, 64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HFImportError, match=f"{shards[0]}: tensors do not match"):
        hf_import.load_weights(model, d)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing half-loaded


def test_tokenizer_larger_than_the_embedding_is_refused(tiny, tmp_path):
    d = edit_config(tiny["smollm"], tmp_path / "m", vocab_size=200)  # the tokenizer has 259 ids (256 bytes + 3 specials)
    with pytest.raises(ValueError, match="tokenizer.json: the tokenizer has ids up to 258 but the model's embedding has 200"):
        TrainConfig(init_from=f"hf:{d}", model={"seq_len": 64})


def test_base_model_tokenize_frames_documents_with_bos_and_eos(tiny, tmp_path):
    import numpy as np
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from lifecycle.core import fs
    from lifecycle.tasks.data.tokenize.base import base_tokens
    from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, run_tokenize, token_shards
    from tests.data.test_tokenizer import make_docs

    framing = base_tokens(tiny["llama3"])
    assert (framing.bos_id, framing.eos_id) == (1, 2)  # config.json: bos 1 (<s>), eos 2 (</s>)
    texts = ["def main():\n    return 0\n", "The quick brown fox.", "import os\n", "x = 1\n"]
    ref = run_tokenize(make_docs(tmp_path, texts), TokenizeConfig(base_model=str(tiny["llama3"]), val_fraction=0.0),
                       str(tmp_path))
    meta = token_shards(ref)
    toks = list(np.memmap(meta.train[0], dtype=meta.dtype, mode="r"))
    tok = Tokenizer.from_file(str(tiny["llama3"] / "tokenizer.json"))
    want = []
    for t in texts:
        want += [1] + tok.encode(t, add_special_tokens=False).ids + [2]
    assert toks == want  # no BPE trained: the model's own tokenizer, BOS + text + EOS
    rows = pq.read_table(sorted(ref.dir.glob("part-*.parquet"))).to_pylist()
    assert all(toks[r["token_start"] - 1] == 1 and toks[r["token_end"]] == 2 for r in rows)
    assert meta.eot_id == 2 and meta.tokenizer_sha256 == fs.sha256_file(tiny["llama3"] / "tokenizer.json")
    inputs = {Path(r["path"]).name for r in ref.manifest()["inputs"]}
    assert {"tokenizer.json", "config.json", "tokenizer_config.json"} <= inputs
    side = json.loads((ref.dir / "tokenizer_config.json").read_text())
    assert (side["bos_token"], side["eos_token"]) == ("<s>", "</s>")


def test_pipeline_config_uses_the_base_tokenizer_and_confines_the_base_dir(tiny, tmp_path):
    from lifecycle.config import ConfigError, load_config

    cfg_path = Path(__file__).resolve().parents[2] / "deploy/configs/continue_llama.yaml"
    d = tiny["llama3"]
    cfg = load_config(cfg_path, [f"train.init_from=hf:{d}", f"workdir={tmp_path / 'w'}"])
    assert cfg.tokenize.base_model == str(d.resolve()) and cfg.train.model.n_kv_head == 2
    with pytest.raises(ConfigError, match="train.init_from"):
        load_config(cfg_path, [f"train.init_from=hf:{d}", f"input_roots=[\"{tmp_path}\"]",
                               f"collect.inputs=[\"{tmp_path}/*.jsonl\"]"])
