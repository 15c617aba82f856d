"""`lifecycle export hf` of the clip demo's registered package: transformers' CLIPModel, with the exported
tokenizer and image processor, gives our model's logits_per_image on real pairs of the bundled corpus; a model
whose layout CLIPModel cannot compute is refused, naming why."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from lifecycle.core.dataset import DatasetRef
from lifecycle.tasks.clip.config import ClipModelConfig
from lifecycle.tasks.clip.evaluate.stage import load_clip
from lifecycle.tasks.clip.export import refusals
from lifecycle.tasks.clip.loader import Pairs
from tests.conftest import last_json, lifecycle

pytestmark = pytest.mark.e2e


def test_the_exported_clipmodel_gives_our_logits_on_real_pairs(clip_demo, tmp_path):
    wd, summary = clip_demo
    package = Path(summary["datasets"]["clip_train"]).parent
    out = tmp_path / "hf"
    report = last_json(lifecycle("export", "hf", package, out, "--workdir", wd, "--json").stdout)
    assert report["architecture"] == "CLIPModel" and report["max_rel_logit_diff_fp32"] <= 1e-5

    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    hf = CLIPModel.from_pretrained(str(out), dtype=torch.float32).eval()
    tok, proc = AutoTokenizer.from_pretrained(str(out)), AutoImageProcessor.from_pretrained(str(out))
    ours = load_clip(DatasetRef.from_dir(package))
    pairs = Pairs(Path(summary["datasets"]["image_preprocess"]).parent)
    rows = list(range(20, 32))  # not the export's own check pairs (the first 8)
    try:
        captions, blobs = [pairs.caption[r] for r in rows], [pairs.read(r) for r in rows]
        ids = tok(captions, padding="max_length", truncation=True, return_tensors="pt").input_ids
        pixels = proc([Image.open(io.BytesIO(b)) for b in blobs], return_tensors="pt").pixel_values
        from lifecycle.tasks.clip.model import caption_tokens

        assert torch.equal(ids, caption_tokens([pairs.tokens[r] for r in rows], ours.cfg))  # the same token ids
    finally:
        pairs.close()
    with torch.no_grad():
        theirs = hf(input_ids=ids, pixel_values=pixels).logits_per_image
        mine = ours.logits_per_image(pixels, ids)
    assert theirs.shape == (12, 12)
    assert ((theirs - mine).abs().max() / mine.abs().max()).item() <= 1e-5
    assert (theirs.argmax(1) == mine.argmax(1)).all()


def test_a_layout_clipmodel_cannot_compute_is_refused_naming_it():
    legacy = ClipModelConfig.from_saved('{"vocab_size": 300}')  # a model_config.json from before the fields
    assert (legacy.image_pre_norm, legacy.text_pool) == (False, "last")
    problems = " ".join(refusals(legacy))
    assert "image_pre_norm=false" in problems and "text_pool='last'" in problems
    assert refusals(ClipModelConfig(vocab_size=300)) == []  # what new runs train
