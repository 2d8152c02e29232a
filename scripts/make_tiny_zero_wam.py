#!/usr/bin/env python
"""Write the tiny Zero-WAM checkpoint (the released layout of robbyant-research/zero-wam-*, random weights).

python scripts/make_tiny_zero_wam.py                  # into the cache (~/.cache/ardiff-server/tiny-zero-wam-*)
python scripts/make_tiny_zero_wam.py --out /tmp/tiny  # anywhere; same bytes every time
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ardiff_policies.lingbot_va.zero_wam_tiny import (
    TINY_ZERO_WAM_SEED,
    default_cache_dir,
    ensure_tiny_zero_wam_checkpoint,
    write_tiny_zero_wam_checkpoint,
)
from ardiff_policies.wan.tiny import describe_written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help=f"output directory (default: {default_cache_dir()})")
    parser.add_argument("--seed", type=int, default=TINY_ZERO_WAM_SEED, help="the transformer's seed (default: %(default)s)")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.out is None and args.seed == TINY_ZERO_WAM_SEED:
        out = ensure_tiny_zero_wam_checkpoint()
    else:
        out = write_tiny_zero_wam_checkpoint(args.out or default_cache_dir(), seed=args.seed)
    print(describe_written(out, time.perf_counter() - start))


if __name__ == "__main__":
    main()
