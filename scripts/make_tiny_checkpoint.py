#!/usr/bin/env python
"""Write the embedded tiny DreamZero checkpoint (real DreamZero-DROID layout, random weights).

    python scripts/make_tiny_checkpoint.py                 # into the cache configs/tiny.yaml uses
    python scripts/make_tiny_checkpoint.py --out /tmp/tiny  # anywhere; same bytes every time
    python scripts/make_tiny_checkpoint.py --family 5b     # builtin:tiny_5b (the Wan2.2-5B layout)
"""

from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

from policies.dreamzero.tiny import default_cache_dir, ensure_tiny_checkpoint, write_tiny_5b_checkpoint, write_tiny_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("14b", "5b"), default="14b", help="builtin:tiny (14b) or builtin:tiny_5b (5b)")
    parser.add_argument("--out", type=Path, help=f"output directory (default: {default_cache_dir()} / the 5B's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    if args.out is None and args.seed == 0:
        out = ensure_tiny_checkpoint(family=args.family)
    else:
        write = write_tiny_5b_checkpoint if args.family == "5b" else write_tiny_checkpoint
        out = write(args.out or default_cache_dir(args.family), seed=args.seed)
    digest = hashlib.sha256()
    files = sorted(p for p in out.rglob("*") if p.is_file())
    for path in files:
        digest.update(path.relative_to(out).as_posix().encode())
        digest.update(path.read_bytes())
    size = sum(p.stat().st_size for p in files)
    print(f"{out}: {len(files)} files, {size / 2**20:.1f} MiB, sha256 {digest.hexdigest()[:16]} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
