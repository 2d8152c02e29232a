"""What both families' tiny checkpoints are made of: UMT5 at toy width, a word-level tokenizer, seeded weights, and
the cache they are generated into once (``~/.cache/ardiff-server``, ``$ARDIFF_CACHE_DIR``).

Each family's ``tiny.py`` writes its checkpoint in its released layout from these; nothing is downloaded and no
weights are committed.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

# UMT5 at toy width (a UMT5Config's fields over UMT5_XXL_ENCODER_CONFIG); vocab_size follows the tokenizer's.
TINY_TEXT_ENCODER = {"d_model": 32, "d_kv": 8, "num_heads": 4, "d_ff": 64, "num_layers": 2}  # + vocab_size


def tiny_tokenizer(corpus: str):
    """A word-level tokenizer over the corpus (T5 specials: <pad> 0, </s> 1, <unk> 2)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for w in pre_tokenizers.WhitespaceSplit().pre_tokenize_str(corpus.lower()) for w in [w[0]]})
    pieces: list[str] = []
    for word in words:
        for piece, _ in pre_tokenizers.Whitespace().pre_tokenize_str(word):
            if piece not in pieces:
                pieces.append(piece)
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2} | {p: i + 3 for i, p in enumerate(sorted(pieces))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def init_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Plausible random values per kind of tensor, so every path carries real signal."""
    leaf = name.rsplit(".", 1)[-1]
    noise = torch.randn(shape, generator=generator, dtype=torch.float32)
    if leaf == "log_scale":
        return torch.tensor(math.log(1 / 0.07))
    if leaf == "gamma" or (leaf == "weight" and len(shape) == 1 and "norm" in name):
        return 1.0 + 0.1 * noise
    if leaf in ("bias", "b") or len(shape) == 1:
        return 0.02 * noise
    if leaf == "modulation":
        return noise / math.sqrt(shape[-1])
    if ("embedding" in name and leaf != "weight") or "pos_embedding" in name or "cls_embedding" in name:
        return 0.02 * noise
    fan_in = shape[-2] if leaf == "W" else math.prod(shape[1:])
    return noise / math.sqrt(max(fan_in, 1))


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def cache_root() -> Path:
    """Where generated checkpoints live: ``$ARDIFF_CACHE_DIR``, else ``$XDG_CACHE_HOME/ardiff-server`` (~/.cache)."""
    return Path(os.environ.get("ARDIFF_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ardiff-server")


def ensure_generated(target: Path, marker: str, write: Callable[[Path], object]) -> Path:
    """``target``, written by ``write(directory)`` unless ``target / marker`` exists. Safe across processes: the
    writer holds a lock beside it and writes a staging directory that is renamed into place, so a reader never sees
    a half-written checkpoint and two processes never write one twice."""
    if (target / marker).exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be writing it right now
        if not (target / marker).exists():
            staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
            try:
                write(staging)
                shutil.rmtree(target, ignore_errors=True)
                staging.rename(target)  # atomic: readers never see a half-written checkpoint
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return target


def tree_digest(directory: str | Path) -> str:
    """sha256 over every file's relative path and bytes (what the parity references record)."""
    directory = Path(directory)
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(path.relative_to(directory).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def describe_written(directory: Path, seconds: float) -> str:
    """The line the ``scripts/make_tiny_*.py`` print for a checkpoint they wrote or found: files, size, digest, time."""
    files = [p for p in directory.rglob("*") if p.is_file()]
    size = sum(p.stat().st_size for p in files)
    return f"{directory}: {len(files)} files, {size / 2**20:.1f} MiB, sha256 {tree_digest(directory)[:16]} ({seconds:.1f} s)"
