"""`lifecycle export hf`: a real transformers load of the export gives our logits (fp32, max abs diff <= 1e-4)."""

import pytest
import torch

from lifecycle.tasks.train import commit as ckpt
from lifecycle.tasks.eval.export import ExportError, export_hf
from lifecycle.tasks.train.model import GPT, ModelConfig
from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, new_bpe
from tests.conftest import corpus_records, last_json, lifecycle


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    tok, trainer = new_bpe(TokenizeConfig(vocab_size=400))
    tok.train_from_iterator([[r["text"] for r in corpus_records(30)]], trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def committed(tmp_path, **model_kw):
    """A committed checkpoint of a randomly initialised model, norm weights perturbed so a wrong mapping shows."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=400, n_layer=2, n_head=4, n_embd=64, seq_len=32, **model_kw)
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    tag = tmp_path / "checkpoints" / "step_00000001"
    tag.mkdir(parents=True)
    ckpt.write_model(tag, model.export_state(), cfg)
    ckpt.commit(tag, 1)
    return tag, model.eval()


@pytest.mark.parametrize("tied", [True, False])
def test_export_loads_with_transformers_and_matches_logits(tmp_path, tokenizer_file, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tag, ours = committed(tmp_path, tie_embeddings=tied, rope_theta=500.0)
    report = export_hf(tag, tmp_path / "hf", tokenizer_file)
    assert report["max_abs_logit_diff_fp32"] <= 1e-4
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.tie_word_embeddings is tied
    ids = torch.randint(0, 400, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(ids)[0] - hf(input_ids=ids).logits).abs().max().item()
        shorter = (ours(ids[:, :7])[0] - hf(input_ids=ids[:, :7]).logits).abs().max().item()
    assert diff <= 1e-4 and shorter <= 1e-4
    text = "Python's list.sort() sorts in place; sorted() returns a new list."
    from tokenizers import Tokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == Tokenizer.from_file(str(tokenizer_file)).encode(
        text, add_special_tokens=False).ids
    assert hf_tok.eos_token == "<|endoftext|>" and hf.config.eos_token_id == hf_tok.eos_token_id


@pytest.mark.parametrize("kw", [{"pos": "learned"}, {"norm": "layernorm"}, {"mlp": "gelu"}])
def test_refuses_architectures_without_an_exact_hf_match(tmp_path, tokenizer_file, kw):
    tag, _ = committed(tmp_path, **kw)
    with pytest.raises(ExportError, match=f"{next(iter(kw))}="):
        export_hf(tag, tmp_path / "hf", tokenizer_file)
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def test_refuses_damaged_checkpoint(tmp_path, tokenizer_file):
    tag, _ = committed(tmp_path)
    (tag / "model.safetensors").write_bytes(b"not the committed weights")
    with pytest.raises(ExportError, match="sha256 mismatch|bytes"):
        export_hf(tag, tmp_path / "hf", tokenizer_file)


def test_cli_export_json(tmp_path, tokenizer_file):
    tag, _ = committed(tmp_path)
    out = last_json(lifecycle("export", "hf", tag, tmp_path / "out", "--tokenizer", tokenizer_file,
                              "--workdir", tmp_path, "--input-root", tokenizer_file.parent, "--json").stdout)
    assert out["status"] == "ok" and out["max_abs_logit_diff_fp32"] <= 1e-4
    assert (tmp_path / "out" / "model.safetensors").exists() and (tmp_path / "out" / "tokenizer.json").exists()
