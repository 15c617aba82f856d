"""The datatrove side of the pipeline benchmarks (`bench.pipeline_throughput`, `bench.real_pipeline`): the script run
in datatrove's own virtual environment (`bench/make_dtvenv.sh`), with the rules, MinHash and PII formatting that
mirror ours. A module of its own, with no imports: `bench.real_pipeline` loads it between timed runs of ours, and
`bench.pipeline_throughput` imports tests.conftest, which sets test settings in `os.environ` (a later `lifecycle
run` would inherit them, and `lifecycle up`'s warm runner declines a run whose environment differs from its own).
"""

DATATROVE_SCRIPT = r"""
import json, sys, time
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                              MinhashDedupFilter, MinhashDedupSignature)
from datatrove.pipeline.filters import C4QualityFilter, FineWebQualityFilter, GopherQualityFilter, GopherRepetitionFilter
from datatrove.pipeline.formatters import PIIFormatter
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter


def run(name, pipeline, tasks):  # fork, not the default forkserver: forked workers are waited for by this
    # process, so their CPU time reaches the benchmark's RUSAGE_CHILDREN (forkserver's grandchildren never do)
    LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=min(n, tasks), logging_dir=f"{wd}/logs/{name}",
                          start_method="fork").run()


if __name__ == "__main__":
    src, wd, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    cfg = MinhashConfig(n_grams=5, num_buckets=14, hashes_per_bucket=8)
    t0 = time.perf_counter()
    run("filter+signatures", [JsonlReader(src), GopherRepetitionFilter(), GopherQualityFilter(),
        C4QualityFilter(filter_no_terminal_punct=False), FineWebQualityFilter(),
        JsonlWriter(f"{wd}/filtered", compression=None), MinhashDedupSignature(f"{wd}/sigs", config=cfg)], n)
    run("buckets", [MinhashDedupBuckets(f"{wd}/sigs", f"{wd}/buckets", config=cfg)], cfg.num_buckets)
    run("cluster", [MinhashDedupCluster(f"{wd}/buckets", f"{wd}/remove", config=cfg)], 1)
    run("dedup+pii", [JsonlReader(f"{wd}/filtered"), MinhashDedupFilter(f"{wd}/remove"), PIIFormatter(),
        JsonlWriter(f"{wd}/output", compression=None)], n)
    print(json.dumps({"seconds": time.perf_counter() - t0}))
"""
