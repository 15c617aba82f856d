"""The image path's training half on a tiny dataset made here (tests/clip/conftest.py): the loader's sampling,
cache and workers, the dual encoder's loss, retrieval recall, and one launched run of 2 DeepSpeed ranks on the CPU
that commits, resumes exactly and is evaluated."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from lifecycle.tasks.clip.augment import decode, decode_batch
from lifecycle.tasks.clip.cache import NoEvictCache
from lifecycle.tasks.clip.config import ClipModelConfig, ClipTrainConfig
from lifecycle.tasks.clip.evaluate.stage import recalls
from lifecycle.tasks.clip.loader import Loader, Pairs, owned_rows, split, step_rows
from lifecycle.tasks.clip.model import CLIP, contrastive_loss, pad_tokens

TINY = ClipModelConfig(image_size=16, patch=8, width=16, layers=1, heads=2, text_width=16, text_layers=1,
                       context=8, embed_dim=16, vocab_size=300)


def test_each_rank_walks_its_own_samples_once_per_epoch_and_the_same_way_again():
    train = list(range(100, 123))  # 23 rows: rank 0 owns 12, rank 1 owns 11
    owned = [owned_rows(train, r, 2) for r in range(2)]
    assert not set(owned[0]) & set(owned[1]) and sorted(owned[0] + owned[1]) == train
    epoch = [row for s in range(3) for row in step_rows(owned[0], 7, s, 0, 4)]  # 12 reads: one epoch
    assert sorted(epoch) == owned[0]
    assert step_rows(owned[0], 7, 5, 0, 4) == step_rows(owned[0], 7, 5, 0, 4)
    assert step_rows(owned[0], 7, 5, 0, 4) != step_rows(owned[0], 8, 5, 0, 4)


def test_held_out_pairs_are_never_in_the_training_list():
    ids = [f"id{i}" for i in range(400)]
    train, held = split(ids, 0.1)
    assert not set(train) & set(held) and len(train) + len(held) == 400 and 20 < len(held) < 60
    assert split(ids, 0.1) == (train, held)


def test_the_cache_keeps_what_it_has_and_never_evicts_for_a_new_read():
    reads = []
    cache = NoEvictCache(capacity=20)

    def get(key):
        return cache.get(key, lambda: reads.append(key) or key.encode() * 10)

    for _ in range(3):  # three random-order epochs over 4 items of 10 bytes: 2 fit
        for key in ("a", "b", "c", "d"):
            get(key)
    assert set(cache.items) == {"a", "b"} and cache.used == 20
    assert reads == ["a", "b", "c", "d", "c", "d", "c", "d"] and cache.hits == 4 and cache.bytes_read == 80


def test_under_random_epochs_the_cache_reads_less_from_disk_than_lru():
    """The point of CoorDL's policy: at a data set of twice the capacity, LRU (the page cache's policy, roughly)
    evicts what the rest of the epoch needs; the no-evict cache reads exactly the uncached half each epoch."""
    from collections import OrderedDict

    items, capacity, epochs = [f"k{i}" for i in range(200)], 100, 5
    cache, lru, lru_read = NoEvictCache(capacity), OrderedDict(), 0
    for e in range(epochs):
        for i in np.random.default_rng(e).permutation(len(items)):
            key = items[i]
            cache.get(key, lambda: b"x")
            if key in lru:
                lru.move_to_end(key)
                continue
            lru_read += 1
            lru[key] = True
            if len(lru) > capacity:
                lru.popitem(last=False)
    assert cache.bytes_read == 200 + 100 * (epochs - 1)  # the first epoch reads all, every later one the other half
    assert lru_read > cache.bytes_read * 1.2


def test_ranks_cache_disjoint_samples_and_workers_decode_the_same_batches(shards):
    pairs = Pairs(shards.dir)
    train, _ = split(pairs.ids, 0.1)
    cfg = ClipTrainConfig(model=TINY, micro_batch=4, workers=0, cache_mb=1)
    loaders = [Loader(Pairs(shards.dir), train, cfg, r, 2, steps=6) for r in range(2)]
    batches = [[ld.next(s)[:2] for s in range(6)] for ld in loaders]
    assert not set(loaders[0].cache.items) & set(loaders[1].cache.items)
    assert set(loaders[0].cache.items) | set(loaders[1].cache.items) == {pairs.ids[r] for r in train}
    pooled = Loader(Pairs(shards.dir), train, cfg.model_copy(update={"workers": 1}), 0, 2, steps=6)
    try:
        for s in range(6):
            images, tokens, wait = pooled.next(s)
            assert torch.equal(images, batches[0][s][0]) and torch.equal(tokens, batches[0][s][1]) and wait >= 0
    finally:
        for ld in (*loaders, pooled):
            ld.close()
    assert batches[0][0][0].shape == (4, 3, 16, 16) and batches[0][0][1].shape == (4, 8)


def test_augmentation_is_a_function_of_its_seed(shards):
    data = Pairs(shards.dir).read(0)
    a, b = decode(data, 16, (0.5, 0.9), (1, 2, 0, 3)), decode(data, 16, (0.5, 0.9), (1, 2, 0, 3))
    assert np.array_equal(a, b) and not np.array_equal(a, decode(data, 16, (0.5, 0.9), (1, 3, 0, 3)))
    assert decode_batch(([data, data], 16, (1.0, 1.0), (0, 0, 0))).shape == (2, 3, 16, 16)


def test_the_loss_rewards_aligned_pairs_and_the_temperature_is_clamped():
    img = torch.nn.functional.normalize(torch.randn(6, 16), dim=-1)
    scale = torch.tensor([np.log(100.0) + 3], dtype=torch.float32)
    aligned = contrastive_loss(img, img, scale)
    shuffled = contrastive_loss(img, img.roll(1, 0), scale)
    assert aligned < 0.1 < shuffled
    assert torch.isclose(contrastive_loss(img, img.roll(1, 0), torch.tensor([np.log(100.0)], dtype=torch.float32)), shuffled)
    model = CLIP(TINY)
    loss = model(torch.randn(3, 3, 16, 16), pad_tokens([[1, 2], [3], [4, 5, 6]], 8, 300))
    loss.backward()
    assert torch.isfinite(loss) and model.logit_scale.grad is not None
    again = CLIP(TINY)
    again.load_export(model.export_state())
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())


def test_recall_counts_ties_against_the_pair():
    perfect = recalls(np.array([1, 1, 1, 1]), np.array([1, 1, 1, 1]), (1, 5), "x")
    assert perfect["x_i2t_recall_at_1"] == 1.0 and perfect["x_chance_at_1"] == 0.25 and perfect["x_chance_at_5"] == 1.0
    tied = recalls(np.array([4, 4, 4, 4]), np.array([4, 4, 4, 4]), (1,), "x")  # all similarities equal
    assert tied["x_i2t_recall_at_1"] == 0.0


def test_bad_shapes_are_refused_naming_the_field():
    with pytest.raises(ValidationError, match="not a multiple of patch"):
        ClipModelConfig(image_size=20, patch=8)
    with pytest.raises(ValidationError, match="crop_scale"):
        ClipTrainConfig(crop_scale=(0.9, 0.5))


def test_a_failed_launch_names_the_ranks_last_error(tmp_path):
    from lifecycle.tasks.clip.train.stage import last_error

    log = tmp_path / "train.log"
    log.write_text("=== start\n[rank1]: Traceback (most recent call last):\n[rank1]: ValueError: rank 1 of 2 owns no "
                   "training pair (1 in all)\n[supervisor] rank 1 (pid 9) exited with code 1\n")
    assert last_error(log) == ": [rank1]: ValueError: rank 1 of 2 owns no training pair (1 in all)"
    log.write_text("nothing wrong\n")
    assert last_error(log) == ""
