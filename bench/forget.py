"""Forgetting a document: knowledge unlearning against retraining, on the demo pipeline.

`python -m bench.forget [--docs N] [--steps S]` (defaults: the world of tests/flows/test_forget_e2e.py: 128
documents of the bundled corpus plus one canary, its SETTINGS' 400 training steps of a small model, so that the
canary is memorised while the model still generalises; the unlearning knobs are its UNLEARN: Jang et al.'s
defaults, 48-token sequences, EL_5, the 10% validation-loss bound). It runs `lifecycle run`, then `lifecycle forget CANARY --unlearn` and `lifecycle forget CANARY
--retrain`, each as a user starts it (a new process: ephemeral Prefect server, MLflow on SQLite, 2 DeepSpeed CPU
ranks for the runs), and prints:
- MA and EL_n of the canary's training sequences before and after unlearning, the never-seen level (val documents
  cut to the same length) and validation loss before and after (Jang et al. 2022's measures, tasks/eval/unlearn.py);
- the wall time of each route, the command's whole run (process start, MLflow, registration included), and the
  unlearning loop alone; their ratio is the result.
Absolute times on a shared 2-core machine are noise; the ratio is what to read.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import corpus_records, last_json, lifecycle  # noqa: E402
from tests.flows.test_forget_e2e import CANARY, DOCS, SETTINGS, UNLEARN, canary_id, sets  # noqa: E402


STEPS = int(next(s for s in SETTINGS if s.startswith("train.max_steps=")).partition("=")[2])


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.forget")
    ap.add_argument("--docs", type=int, default=DOCS, help="documents of the bundled corpus beside the canary")
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps of the first run (and of the retrain)")
    a = ap.parse_args(argv)
    extra = [f"train.max_steps={a.steps}"]
    with tempfile.TemporaryDirectory() as tmp:
        wd, inputs_dir = Path(tmp) / "work", Path(tmp) / "inputs"
        inputs_dir.mkdir()
        sid = canary_id()
        with open(inputs_dir / "docs.jsonl", "w") as f:
            for r in corpus_records(a.docs) + [{"id": sid, "text": CANARY}]:
                f.write(json.dumps(r) + "\n")
        inputs = [str(inputs_dir / "*.jsonl")]
        args = sets(wd, inputs, extra)
        t0 = time.time()
        last_json(lifecycle("run", args[1], "--json", *args[2:]).stdout)  # the first run: trained and registered
        t_first = time.time() - t0
        t0 = time.time()
        un = last_json(lifecycle("forget", sid, "--reason", "bench", "--unlearn", *UNLEARN, "--json", *args).stdout)
        t_unlearn = time.time() - t0
        t0 = time.time()
        re = last_json(lifecycle("forget", sid, "--reason", "bench", "--retrain", "--json", *args).stdout)
        t_retrain = time.time() - t0
    m = un["metrics"]
    el = next(k.removeprefix("never_seen_") for k in m if k.startswith("never_seen_el"))
    result = {"first_run_s": t_first, "unlearn_status": un["status"], "unlearn_s": t_unlearn,
              "unlearn_loop_s": m.get("unlearn_wall_s"), "retrain_s": t_retrain, "retrain_status": re["status"],
              "retrain_over_unlearn": t_retrain / t_unlearn, "metrics": m, "settings": SETTINGS + extra,
              "unlearn_settings": UNLEARN[1::2]}
    print(f"bench.forget: {a.docs} documents + 1 canary, {a.steps} steps ({', '.join(SETTINGS[:1] + extra)})")
    print(f"  canary sequences: {m['forget_sequences']} of {m['sequence_tokens']} tokens; never-seen: "
          f"{m['never_seen_sequences']}")
    print(f"  {'':<22}{'before':>10}{'after':>10}{'never-seen':>12}")
    print(f"  {'MA':<22}{m['forgotten_ma_before']:>10.3f}{m.get('forgotten_ma_after', float('nan')):>10.3f}"
          f"{m['never_seen_ma']:>12.3f}")
    print(f"  {el.upper():<22}{m[f'forgotten_{el}_before']:>10.3f}"
          f"{m.get(f'forgotten_{el}_after', float('nan')):>10.3f}{m[f'never_seen_{el}']:>12.3f}")
    print(f"  {'val_loss':<22}{m['val_loss_before']:>10.4f}{m.get('val_loss_after', float('nan')):>10.4f}")
    print(f"  unlearn: {un['status']} in {t_unlearn:.1f} s (loop {m.get('unlearn_wall_s', float('nan')):.1f} s, "
          f"{m.get('unlearn_steps')} steps); retrain: {re['status']} in {t_retrain:.1f} s; "
          f"retrain / unlearn = {t_retrain / t_unlearn:.1f}x (first run {t_first:.1f} s)")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
