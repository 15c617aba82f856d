import threading
import time

import pytest

from lifecycle.tasks.train.loader import Prefetcher, data_step


def test_data_step_skips_rolled_back_steps():
    assert [data_step(s, []) for s in range(5)] == [0, 1, 2, 3, 4]
    assert [data_step(s, [2]) for s in range(5)] == [0, 1, 3, 4, 5]
    assert [data_step(s, [2, 3, 7]) for s in range(7)] == [0, 1, 4, 5, 6, 8, 9]
    assert [data_step(s, [0, 1]) for s in range(3)] == [2, 3, 4]


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_prefetch_yields_the_same_sequence_in_order(depth):
    keys = [(s, m) for s in range(6) for m in range(2)]
    p = Prefetcher(lambda k: k[0] * 10 + k[1], keys, depth)
    assert [p.get(k) for k in keys] == [s * 10 + m for s, m in keys]
    p.close()


def test_prefetch_hides_load_time_and_measures_the_wait():
    # loading takes 20 ms, the "step" 40 ms: with prefetch the step never waits after the first item
    def load(k):
        time.sleep(0.02)
        return k

    for depth, bound in ((2, 0.05), (0, 0.15)):
        p = Prefetcher(load, range(8), depth)
        p.get(0)
        p.take_wait()
        for k in range(1, 8):
            time.sleep(0.04)
            assert p.get(k) == k
        wait = p.take_wait()
        p.close()
        if depth:
            assert wait < bound, wait
        else:
            assert wait >= 7 * 0.02  # synchronous loading is all wait


def test_prefetch_errors_and_order_are_reported():
    def load(k):
        if k == 2:
            raise OSError("disk gone")
        return k

    p = Prefetcher(load, range(5), 2)
    assert p.get(0) == 0 and p.get(1) == 1
    with pytest.raises(RuntimeError, match="prefetch thread failed") as e:
        p.get(2)
    assert isinstance(e.value.__cause__, OSError)
    q = Prefetcher(lambda k: k, range(5), 2)
    with pytest.raises(RuntimeError, match="order broken"):
        q.get(1)
    q.close()
    assert not any(t.name == "prefetch" and t.is_alive() for t in threading.enumerate() if t is not p._thread)
