"""Global negatives (clip_train.negatives: global; lifecycle.tasks.clip.model.global_contrastive_loss): 2 gloo
processes, each with half of a batch of features, give the loss and the gradients one process computes over the
whole batch with the local loss (after DeepSpeed's averaging over ranks)."""

import os

import torch
import torch.multiprocessing as mp

from lifecycle.core.procs import free_port
from lifecycle.tasks.clip.model import contrastive_loss, global_contrastive_loss

N, D = 6, 8  # pairs per rank, feature width


def features(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    img = torch.nn.functional.normalize(torch.randn(2 * N, D, generator=g), dim=-1)
    txt = torch.nn.functional.normalize(torch.randn(2 * N, D, generator=g), dim=-1)
    return img, txt, torch.tensor([2.0])


def rank_main(rank: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    img, txt, scale = features()
    mine = slice(rank * N, (rank + 1) * N)
    img, txt = img[mine].clone().requires_grad_(), txt[mine].clone().requires_grad_()
    scale.requires_grad_()
    loss = global_contrastive_loss(img, txt, scale)
    loss.backward()
    out[rank] = (loss.item(), img.grad, txt.grad, scale.grad)
    dist.destroy_process_group()


def test_two_ranks_of_global_negatives_are_the_one_rank_loss_of_the_whole_batch():
    img, txt, scale = (t.clone().requires_grad_() for t in features())
    full = contrastive_loss(img, txt, scale)
    full.backward()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(rank_main, args=(free_port(), out), nprocs=2, start_method="spawn")
        got = dict(out)
    mean = (got[0][0] + got[1][0]) / 2  # the loss the trainer logs, and DeepSpeed's gradient average below
    assert abs(mean - full.item()) < 1e-6
    for rank in (0, 1):
        mine = slice(rank * N, (rank + 1) * N)
        torch.testing.assert_close(got[rank][1] / 2, img.grad[mine], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got[rank][2] / 2, txt.grad[mine], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close((got[0][3] + got[1][3]) / 2, scale.grad, rtol=1e-5, atol=1e-7)
    # against the local loss, which sees only N - 1 negatives per row: not the same task
    local = sum(contrastive_loss(*(t[r * N:(r + 1) * N] for t in features()[:2]), torch.tensor([2.0])).item()
                for r in (0, 1)) / 2
    assert abs(local - full.item()) > 1e-3
