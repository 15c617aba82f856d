"""bench.image_cache's walk without the cgroup (the cgroup run needs root and a memory controller; its figure is in
docs/benchmarks.md): once the no-evict cache holds the whole data set, later epochs read nothing through it, and
a cache of half the data set hits on half of each later epoch, whatever the order."""

from bench.image_cache import make_dataset, places, walk


def test_places_fill_the_shards_in_order():
    where = places(35, 10)
    assert len(where) == 35 and where[0] == ("shard-00.bin", 0) and where[3] == ("shard-01.bin", 0)
    assert len({w for w in where}) == 35


def test_no_evict_cache_keeps_what_it_took(tmp_path):
    size, items = 4096, 64
    make_dataset(tmp_path, items, size)
    whole = walk("no_evict", tmp_path, items, size, epochs=3, capacity=10**12)
    assert [e["hits"] for e in whole["epochs"]] == [0, items, items]
    half = walk("no_evict", tmp_path, items, size, epochs=3, capacity=items // 2 * size)
    assert [e["hits"] for e in half["epochs"]] == [0, items // 2, items // 2]
    assert walk("page_cache", tmp_path, items, size, epochs=2, capacity=10**12)["epochs"][1]["hits"] == 0
