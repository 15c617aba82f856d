"""clip_train's DALI backend (`clip_train.loader: dali`): the same batches as the worker processes' (same rows,
same order, same crop boxes), decoded, cropped, resized and normalised by an NVIDIA DALI pipeline.

The training loop's process reads each step's JPEG bytes through the rank's no-evict cache (`Reads`, shared with
the workers backend) and draws each image's crop box from `(seed, step, rank, j)` (augment.crop_box, from the
JPEG header's size); `fn.external_source` hands bytes and boxes to the pipeline, `prefetch` steps ahead. Inside
DALI: `fn.decoders.image` (libjpeg-turbo on DALI's CPU threads; nvJPEG, `device="mixed"`, on CUDA),
`fn.resize` of the box (`roi_start`/`roi_end`, in pixels) to image_size with cubic interpolation, and
`fn.crop_mirror_normalize` to CLIP's mean and std in (3, size, size) float32. On CUDA the batch stays on the GPU
(`feed_ndarray` into a torch tensor on the rank's device).

What differs from Pillow: the decoders' and the resize filters' rounding, a few levels of 255 on a pixel
(the figures, and the interpolation chosen to be closest, in docs/data.md; tests/clip/test_clip_dali.py bounds
them). The crop itself is reproduced exactly: its box is computed once, in Python, for both backends.

Stall: `next(step)` returns the seconds the loop waited for the pipeline's output, as the workers backend does."""

from __future__ import annotations

import io
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from PIL import Image

from lifecycle.tasks.clip.augment import MEAN, STD, crop_box
from lifecycle.tasks.clip.config import ClipTrainConfig
from lifecycle.tasks.clip.loader import Pairs, Reads

INTERP = "INTERP_CUBIC"  # DALI's filter closest to Pillow's bicubic (docs/data.md)


def boxes(blobs: list[bytes], scale: tuple[float, float], seed: int, step: int,
          rank: int) -> tuple[np.ndarray, np.ndarray]:
    """Each image's crop box as DALI's ROI: (n, 2) float32 starts (y0, x0) and ends (y1, x1), in the shape order of
    an HWC image."""
    out = np.empty((2, len(blobs), 2), dtype=np.float32)
    for j, data in enumerate(blobs):
        w, h = Image.open(io.BytesIO(data)).size  # the header only
        x0, y0, x1, y1 = crop_box(w, h, scale, (seed, step, rank, j))
        out[:, j] = ((y0, x0), (y1, x1))
    return out[0], out[1]


def pipeline(source, cfg: ClipTrainConfig, device_id: int | None, interp: str = INTERP):
    """The DALI pipeline of one rank: external bytes and boxes -> decode -> resize the box -> normalise."""
    from nvidia.dali import fn, pipeline_def, types

    size = cfg.model.image_size

    @pipeline_def(batch_size=cfg.micro_batch, num_threads=max(1, cfg.workers), device_id=device_id,
                  prefetch_queue_depth=cfg.prefetch, seed=cfg.seed, exec_async=True, exec_pipelined=True)
    def graph():
        jpegs, start, end = fn.external_source(source=source, num_outputs=3, batch=True, batch_info=True,
                                               dtype=[types.UINT8, types.FLOAT, types.FLOAT])
        on_gpu = device_id is not None
        images = fn.decoders.image(jpegs, device="mixed" if on_gpu else "cpu", output_type=types.RGB)
        images = fn.resize(images, device="gpu" if on_gpu else "cpu", size=[size, size], roi_start=start,
                           roi_end=end, interp_type=getattr(types, interp), antialias=True)
        return fn.crop_mirror_normalize(images, device="gpu" if on_gpu else "cpu", dtype=types.FLOAT,
                                        output_layout="CHW", mean=(MEAN * 255).tolist(), std=(STD * 255).tolist())

    pipe = graph()
    pipe.build()
    return pipe


class DaliLoader(Reads):
    """Batches of (images, tokens) for one rank from a DALI pipeline; the steps must be asked for in order, from
    any first step (a resumed run's)."""

    def __init__(self, pairs: Pairs, train_rows: list[int], cfg: ClipTrainConfig, rank: int, ranks: int,
                 steps: int, device_id: int | None = None, interp: str = INTERP):
        super().__init__(pairs, train_rows, cfg, rank, ranks, steps)
        self.device_id, self.interp = device_id, interp
        self.first: int | None = None
        self.fed: deque[tuple[int, list[int]]] = deque()  # (step, rows) handed to the pipeline, not yet taken
        # one thread reads and boxes the next step (the cache sees the reads in step order, as with workers)
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="dali-reads")
        self.ahead: dict[int, Future] = {}
        self.pipe: Any = None

    def _prepare(self, step: int) -> tuple[list[int], list[np.ndarray], np.ndarray, np.ndarray]:
        """A step's rows, bytes and crop boxes (on the reader thread)."""
        rows, blobs = self.reads(step)
        start, end = boxes(blobs, tuple(self.cfg.crop_scale), self.cfg.seed, step, self.rank)
        return rows, [np.frombuffer(b, dtype=np.uint8) for b in blobs], start, end

    def _feed(self, info) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
        """external_source's callback: the batch of iteration `info.iteration`, i.e. step first + iteration, read
        and boxed on the reader thread while the step before it trained; the next one is handed to it now."""
        assert self.first is not None
        step = self.first + info.iteration
        if step >= self.steps:
            raise StopIteration
        if step not in self.ahead:
            self.ahead[step] = self.reader.submit(self._prepare, step)
        if step + 1 < self.steps:
            self.ahead[step + 1] = self.reader.submit(self._prepare, step + 1)
        rows, blobs, start, end = self.ahead.pop(step).result()
        self.fed.append((step, rows))
        return blobs, start, end

    def next(self, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
        """(images, tokens, seconds waited) of `step` (on the GPU `device_id` under CUDA)."""
        from nvidia.dali.plugin.pytorch import feed_ndarray

        t0 = time.perf_counter()
        if self.pipe is None:
            self.first = step
            self.pipe = pipeline(self._feed, self.cfg, self.device_id, self.interp)
        (out,) = self.pipe.run()
        got, rows = self.fed.popleft()
        if got != step:
            raise RuntimeError(f"the DALI loader was asked for step {step} after step {got - 1}: steps go in order")
        batch = out.as_tensor()
        device = torch.device("cpu") if self.device_id is None else torch.device("cuda", self.device_id)
        images = torch.empty(batch.shape(), dtype=torch.float32, device=device)
        feed_ndarray(batch, images, cuda_stream=torch.cuda.current_stream(device) if device.type == "cuda" else None)
        return images, self.tokens(rows), time.perf_counter() - t0

    def close(self) -> None:
        self.reader.shutdown(cancel_futures=True)
        self.pipe = None  # the pipeline and its threads go with the last reference
        super().close()
