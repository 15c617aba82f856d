"""The training benchmarks of issue 4, in one run: `python -m bench.training` (kills: LIFECYCLE_KILLS, default 10).

- bench.train_speed: tokens/s of a plain PyTorch loop vs our DeepSpeed path at ZeRO-0/1/2, stall fraction;
- bench.ckpt_stall: training stall of an async vs a synchronous checkpoint save;
- bench.demo_stall: stall fraction and MFU of a 2-rank run of the demo train config;
- bench.kill_resume: SIGKILLs at random moments (and inside saves), bitwise-identical resumes counted;
- bench.activation_memory: peak activation memory and step time with and without activation checkpointing.
"""

import os

from bench import activation_memory, ckpt_stall, demo_stall, kill_resume, train_speed


def main() -> None:
    train_speed.main()
    ckpt_stall.main()
    demo_stall.main()
    kill_resume.main(int(os.environ.get("LIFECYCLE_KILLS", "10")))
    activation_memory.main()


if __name__ == "__main__":
    main()
