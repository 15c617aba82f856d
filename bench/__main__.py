"""Run every benchmark: `make bench` (or `python -m bench`). Each reports ratios against a peer measured
in the same run; absolute times on a shared machine are noise."""

from bench import filter_agreement, minhash_signatures

if __name__ == "__main__":
    minhash_signatures.main()
    filter_agreement.main()
    __import__("bench.pipeline_throughput").pipeline_throughput.main([])  # issue 3: pipeline vs datatrove
    __import__("bench.training").training.main()  # issue 4: speed, checkpoint stall, demo stall, kill/resume
