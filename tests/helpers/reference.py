"""Where the upstream reference numbers live: ``../shared/reference/`` next to the repository
(override with ``ARDIFF_REFERENCE_DIR``). Tests that need them skip, saying so, when absent."""

from __future__ import annotations

import os
from pathlib import Path

REFERENCE_DIR = Path(os.environ.get("ARDIFF_REFERENCE_DIR") or Path(__file__).resolve().parents[3] / "shared" / "reference")
