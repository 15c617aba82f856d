"""The train stage's code for the stage registry (tasks/stages.py): `run_train` (launch.py) writes the launch
config, starts and supervises the DeepSpeed ranks, and returns the final committed checkpoint."""

from lifecycle.core.shards import StageCode
from lifecycle.tasks.train.launch import run_train

STAGE = StageCode(run=run_train)
