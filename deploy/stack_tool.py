"""The small parts of deploy/stack.sh that are easier in Python: wait for a service's health URL, create the
artifact bucket. Standard library and boto3 only (boto3 is in the `team` extra); no secret is ever printed.

    python deploy/stack_tool.py wait URL [TIMEOUT_S] [PID]   # exit 1 naming the URL when it does not answer 200
    python deploy/stack_tool.py bucket s3://BUCKET[/prefix]  # create it at $MLFLOW_S3_ENDPOINT_URL if missing
"""

from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.request


def wait_http(url: str, timeout_s: float = 60, pid: int | None = None) -> None:
    """Poll `url` until it answers 200. With `pid`, stop early when that process has exited (its log says why)."""
    deadline, last = time.monotonic() + timeout_s, "no answer"
    while time.monotonic() < deadline:
        if pid is not None and not os.path.exists(f"/proc/{pid}"):
            raise SystemExit(f"stack: {url}: the process (pid {pid}) exited before it answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
                last = f"HTTP {r.status}"
        except urllib.error.HTTPError as e:
            last = f"HTTP {e.code}"
        except (urllib.error.URLError, OSError) as e:
            last = str(getattr(e, "reason", e))
        time.sleep(0.5)
    raise SystemExit(f"stack: {url} did not answer 200 within {timeout_s:g} s (last: {last})")


def make_bucket(uri: str) -> None:
    """Create the bucket of `s3://bucket/...` at MLFLOW_S3_ENDPOINT_URL (credentials: the usual AWS variables or
    AWS_SHARED_CREDENTIALS_FILE), unless it exists."""
    import boto3
    from botocore.exceptions import ClientError

    if not uri.startswith("s3://"):
        raise SystemExit(f"stack: LIFECYCLE_ARTIFACTS must be an s3:// URI, not {uri!r}")
    bucket = uri[5:].split("/", 1)[0]
    s3 = boto3.client("s3", endpoint_url=os.environ.get("MLFLOW_S3_ENDPOINT_URL"))
    try:
        s3.head_bucket(Bucket=bucket)
    except ClientError:
        s3.create_bucket(Bucket=bucket)


def main(argv: list[str]) -> None:
    if len(argv) >= 2 and argv[0] == "wait":
        wait_http(argv[1], float(argv[2]) if len(argv) > 2 else 60, int(argv[3]) if len(argv) > 3 else None)
    elif len(argv) == 2 and argv[0] == "bucket":
        make_bucket(argv[1])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
