"""The former name of `lifecycle.tasks.train.commit` (the checkpoint commit protocol), kept as the very same module
object for the callers outside tasks/train that still import it by this name: lifecycle/cli.py, tasks/eval/,
tasks/train/parallel/pp.py, tests/faults.py, tests/eval/ and tests/core/test_integrity.py. Delete it once they
import `commit`."""

import sys

from lifecycle.tasks.train import commit

sys.modules[__name__] = commit
