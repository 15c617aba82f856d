"""Run every benchmark: `make bench` (or `python -m bench`). Each reports ratios against a peer measured
in the same run; absolute times on a shared machine are noise."""

from bench import filter_agreement, minhash_signatures

if __name__ == "__main__":
    minhash_signatures.main()
    filter_agreement.main()
    __import__("bench.pipeline_throughput").pipeline_throughput.main([])  # issue 3: pipeline vs datatrove
    __import__("bench.dedup_memory").dedup_memory.main([40_000, 160_000, 640_000, 1_280_000])  # issue 3: bounded memory
    __import__("bench.training").training.main()  # issue 4: speed, checkpoint stall, demo stall, kill/resume
