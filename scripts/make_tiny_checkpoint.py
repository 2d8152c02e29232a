#!/usr/bin/env python
"""Write an embedded tiny DreamZero checkpoint (real DreamZero-DROID layout, random weights).

python scripts/make_tiny_checkpoint.py                 # into the cache configs/tiny.yaml uses
python scripts/make_tiny_checkpoint.py --out /tmp/tiny  # anywhere; same bytes every time
python scripts/make_tiny_checkpoint.py --variant tiny_5b                   # builtin:tiny_5b (the Wan2.2-5B layout)
python scripts/make_tiny_checkpoint.py --variant tiny_yam --out /tmp/yam   # a post-trained-style YAM run
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ardiff_policies.dreamzero.tiny import TINY_VARIANTS, default_cache_dir, ensure_tiny_checkpoint, write_tiny_checkpoint
from ardiff_policies.wan.tiny import describe_written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help=f"output directory (default: {default_cache_dir()})")
    parser.add_argument(
        "--variant",
        choices=sorted(TINY_VARIANTS),
        default="tiny",
        help="which embedded checkpoint: builtin:<variant> (default tiny: DROID on the 14B layout)",
    )
    parser.add_argument("--seed", type=int, help="weights' seed (default: the variant's)")
    args = parser.parse_args()
    start = time.perf_counter()
    if args.out is None and args.seed is None:
        out = ensure_tiny_checkpoint(variant=args.variant)
    else:
        out = write_tiny_checkpoint(args.out or default_cache_dir(args.variant), seed=args.seed, variant=args.variant)
    print(describe_written(out, time.perf_counter() - start))


if __name__ == "__main__":
    main()
