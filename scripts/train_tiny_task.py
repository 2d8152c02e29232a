#!/usr/bin/env python
"""Train the task model once (``ardiff_sim.task_model``: the tiny DreamZero on ``ardiff_sim.tiny_task``) and print
its directory; cached, so a second run prints it at once::

    .venv/bin/python scripts/train_tiny_task.py                # train once, print the cached directory
    .venv/bin/python scripts/train_tiny_task.py --steps 200 --out /tmp/task   # a short run anywhere
    ardiff-serve --set policy.checkpoint=<that directory> --set policy.view_size=[48,80]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ardiff_sim.task_model import DEFAULT_STEPS, ensure_task_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"optimizer steps (default {DEFAULT_STEPS})")
    parser.add_argument("--out", type=Path, help="output directory (default: the cache)")
    args = parser.parse_args()
    started = time.perf_counter()
    out = ensure_task_checkpoint(args.steps, args.out)
    print(f"{out} ({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
