"""Import a Hugging Face checkpoint: time and peak RSS of ours against `AutoModelForCausalLM.from_pretrained`.

    python -m bench.hf_import                     # a random ~1B Llama saved sharded in a temp dir, both loaders
    python -m bench.hf_import --params 0.1        # smaller (billions of parameters)
    python -m bench.hf_import --make-tiny DIR     # a tiny random Llama 3 checkpoint + tokenizer (for the
                                                  # deploy/configs/continue_llama.yaml example and the tests)

Each loader runs in a fresh subprocess; its peak RSS is that child's own `ru_maxrss` (resource.getrusage
RUSAGE_SELF at its end), its time the wall time of the load call inside it. Both load fp32 on CPU.
Nothing is downloaded: the checkpoint is built from a config with random weights.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

FAMILIES = ("llama2", "llama3", "mistral", "qwen2", "smollm")
SPECIALS = ["<unk>", "<s>", "</s>"]


def tiny_tokenizer(out: Path, vocab_size: int = 256) -> None:
    """A byte-level BPE with <unk>, <s>, </s> as ids 0-2 (offline), and a tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["def main():\n    return 0\n", "The quick brown fox jumps over the lazy dog.", "import os, sys\n"] * 20
    tok.train_from_iterator(text, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))


def hf_config(family: str, hidden: int = 64, layers: int = 2, vocab: int = 320, max_pos: int = 256):
    """A transformers config of a family, small (heads of 16 channels)."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    heads = max(2, hidden // 16)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 5 // 2 + 8, num_hidden_layers=layers,
                  num_attention_heads=heads, max_position_embeddings=max_pos, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2)
    if family == "llama2":
        return LlamaConfig(**common, num_key_value_heads=heads, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "llama3":
        return LlamaConfig(**common, num_key_value_heads=heads // 2, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 32})
    if family == "mistral":
        return MistralConfig(**common, num_key_value_heads=heads // 2, tie_word_embeddings=False, sliding_window=None,
                             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "qwen2":
        return Qwen2Config(**common, num_key_value_heads=heads // 2, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "smollm":
        return LlamaConfig(**common, num_key_value_heads=1, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    raise ValueError(f"family {family!r} is not one of {FAMILIES}")


def make_tiny(out: str | Path, family: str = "llama3", shard_size: str | None = None, seed: int = 0,
              **shape) -> Path:
    """Save a random model of `family` (plus a tiny tokenizer) into `out`; `shard_size` (e.g. "50KB") saves it
    sharded with an index."""
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **shape), dtype=torch.float32)
    model.save_pretrained(str(out), **({"max_shard_size": shard_size} if shard_size else {}))
    tiny_tokenizer(out)
    return out


def make_big(out: Path, params_b: float) -> Path:
    """A random Llama of about `params_b` billion parameters (hidden 2048, GQA 32/8 heads, vocab 32000), saved in
    shards of 1 GB; built on the meta device and filled tensor by tensor (one copy of the weights)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    hidden, inter, vocab = 2048, 5632, 32000
    per_layer = hidden * hidden * 2 + 2 * hidden * (hidden // 4) + 3 * hidden * inter
    layers = max(1, round((params_b * 1e9 - 2 * vocab * hidden) / per_layer))
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen)
    model.save_pretrained(str(out), max_shard_size="1GB")
    tiny_tokenizer(out)
    return out


CHILD = {
    "ours": "from lifecycle.tasks.train.hf_import import load_hf\nm = load_hf(D, seq_len=128)\n",
    "transformers": "from transformers import AutoModelForCausalLM\n"
                    "m = AutoModelForCausalLM.from_pretrained(D, dtype=torch.float32)\n",
    # transformers 5 may leave fp32 weights memory-mapped from the safetensors files, read only when first used:
    # touching every weight once makes its load comparable with ours, which reads and copies everything
    "transformers+touch": "from transformers import AutoModelForCausalLM\n"
                          "m = AutoModelForCausalLM.from_pretrained(D, dtype=torch.float32)\n"
                          "_ = [float(p.detach().sum()) for p in m.parameters()]\n",
}


def measure(side: str, directory: Path) -> dict:
    """Load time (inside the child, imports excluded) and the child's own peak RSS (getrusage RUSAGE_SELF at
    its end: the maximum resident set over its life, imports included)."""
    code = (f"import time, json, resource\nD = {str(directory)!r}\nimport torch\n"
            f"base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\nt = time.perf_counter()\n{CHILD[side]}"
            "s = time.perf_counter() - t\nn = sum(p.numel() for p in m.parameters())\n"
            "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "print(json.dumps({'seconds': s, 'params': n, 'peak_rss_gib': peak / 2**20, "
            "'rss_before_load_gib': base / 2**20}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=1.0, help="billions of parameters of the random Llama (<= 1)")
    ap.add_argument("--make-tiny", metavar="DIR", help="only write a tiny random Llama 3 checkpoint into DIR")
    args = ap.parse_args(argv)
    if args.make_tiny:
        print(make_tiny(args.make_tiny, "llama3", shard_size="200KB", hidden=64, layers=2))
        return
    if args.params > 1.0:
        raise SystemExit("--params above 1 (billion) is more than this shared machine should hold")
    with tempfile.TemporaryDirectory(prefix="hf-import-") as tmp:
        # built in a child too: a child's ru_maxrss starts from its parent's RSS at fork, so this process must
        # stay small for the loaders' peaks to be theirs
        subprocess.run([sys.executable, "-c", f"from bench.hf_import import make_big; from pathlib import Path; "
                        f"make_big(Path({tmp!r}), {args.params})"], check=True, capture_output=True)
        d = Path(tmp)
        size = sum(f.stat().st_size for f in d.glob("*.safetensors"))
        rows = {side: measure(side, d) for side in CHILD}
    print(json.dumps({"checkpoint_gib": size / 2**30, **rows}, indent=2))
    for side, r in rows.items():
        print(f"{side:>18}: {r['params'] / 1e9:.3f}B params, load {r['seconds']:.1f}s, peak RSS "
              f"{r['peak_rss_gib']:.2f} GiB (before the load {r['rss_before_load_gib']:.2f} GiB)")


if __name__ == "__main__":
    main()
