"""Issue 47's check, under pipeline and sequence parallelism: changing one document's tokens leaves every other
document's logits in the same window unchanged (the dense model and tp=2: tests/train/test_recipe.py). Two gloo
processes, one spawn: sp=2 (each rank holds half of the window, the changed document straddles the halves) and a
real two-stage DeepSpeed pipeline (the logits come off the last stage through `eval_batch`)."""

from __future__ import annotations

import os

import torch

from lifecycle.core.procs import free_port
from lifecycle.tasks.train.config import ModelConfig

EOT = 0
CFG = ModelConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, seq_len=16)
A, C = [3, 4, 5], [13, 14, 15, 16, 17]
B = {"base": [8, 9, 10, 11, 12], "changed": [20, 21, 22, 23, 24]}
N_A, N_B = len(A) + 1, len(B["base"]) + 1  # the second document is tokens 4..9: across the sp halves 0..7, 8..15


def _window(b: list[int]) -> torch.Tensor:
    return torch.tensor([[t for d in (A, b, C) for t in (*d, EOT)]])


def _sp_logits(rank: int) -> dict:
    import torch.distributed as dist

    from lifecycle.tasks.train.model import GPT
    from lifecycle.tasks.train.parallel.mesh import Grid, Mesh
    from lifecycle.tasks.train.parallel.sp import SequenceParallel

    sp = SequenceParallel(Mesh(Grid(sp=2), rank))
    torch.manual_seed(0)
    model = sp.wrap(GPT(CFG)).eval()
    model.doc_sep = EOT
    out = {}
    for name, b in B.items():
        x = _window(b)
        part = sp.shard(x, x)[0]
        local = model(part)[0].detach()
        parts = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(parts, local)
        out[name] = torch.cat(parts, dim=1)
    return out


def _pp_logits() -> dict | None:
    import deepspeed

    from lifecycle.tasks.train.model import GPT
    from lifecycle.tasks.train.parallel import pp

    torch.manual_seed(0)
    model = GPT(CFG)
    model.doc_sep = EOT
    pipe = pp.pipeline_module(model, pp=2, dp=1, activation_checkpointing=False)
    engine, *_ = deepspeed.initialize(model=pipe, optimizer=torch.optim.AdamW(pipe.parameters(), lr=1e-3), config={
        "train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1}, "steps_per_print": 10**9, "zero_allow_untested_optimizer": True})
    out = {}
    for name, b in B.items():
        x = _window(b)
        got = engine.eval_batch(iter([(x, x)]), return_logits=True, num_micro_batches=1)
        out[name] = got[1].detach() if pipe.stage_id == 1 else None
    return out if pipe.stage_id == 1 else None


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_SIZE="2")
    import deepspeed
    import torch.distributed as dist

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo")
    torch.save({"sp": _sp_logits(rank), "pp": _pp_logits()}, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def _isolated(logits: dict) -> None:
    base, changed = logits["base"], logits["changed"]
    torch.testing.assert_close(changed[:, :N_A], base[:, :N_A], rtol=0, atol=1e-6)  # the document before
    torch.testing.assert_close(changed[:, N_A + N_B:], base[:, N_A + N_B:], rtol=0, atol=1e-5)  # and after
    assert not torch.allclose(changed[:, N_A:N_A + N_B], base[:, N_A:N_A + N_B])  # the changed one changed


def test_changing_one_document_leaves_the_others_logits_unchanged_under_sp2_and_pp2(tmp_path):
    import torch.multiprocessing as mp

    from lifecycle.tasks.train.model import GPT

    out = str(tmp_path / "r")
    mp.start_processes(_worker, args=(free_port(), out), nprocs=2, start_method="spawn")
    got = [torch.load(f"{out}.{r}") for r in range(2)]
    torch.manual_seed(0)
    dense = GPT(CFG).eval()
    dense.doc_sep = EOT
    with torch.no_grad():
        want = {name: dense(_window(b))[0] for name, b in B.items()}
    for logits in (got[0]["sp"], got[1]["sp"], got[1]["pp"]):
        _isolated(logits)
        for name in B:  # and they are the dense document-aware model's
            torch.testing.assert_close(logits[name], want[name], rtol=1e-5, atol=1e-5)
    assert got[0]["pp"] is None  # the first stage has no logits
