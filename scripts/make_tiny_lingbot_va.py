#!/usr/bin/env python
"""Write the tiny LingBot-VA checkpoint (the released diffusers-style layout, random weights).

python scripts/make_tiny_lingbot_va.py                  # into the cache (~/.cache/ardiff-server/tiny-lingbot-va-*)
python scripts/make_tiny_lingbot_va.py --out /tmp/tiny  # anywhere; same bytes every time
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ardiff_policies.lingbot_va.tiny import TINY_SEED, default_cache_dir, ensure_tiny_checkpoint, write_tiny_checkpoint
from ardiff_policies.wan.tiny import describe_written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help=f"output directory (default: {default_cache_dir()})")
    parser.add_argument("--seed", type=int, default=TINY_SEED, help="weights' seed (default: %(default)s)")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.out is None and args.seed == TINY_SEED:
        out = ensure_tiny_checkpoint()
    else:
        out = write_tiny_checkpoint(args.out or default_cache_dir(), seed=args.seed)
    print(describe_written(out, time.perf_counter() - start))


if __name__ == "__main__":
    main()
