"""A Hugging Face hub cache written by hand, in the hub's own layout, for tests that never reach the network.

``<cache>/models--<org>--<name>/`` holds ``blobs/<etag>`` (the git blob sha1 of a small file, the
sha256 of an LFS one), ``snapshots/<commit>/<path>`` as relative symlinks into ``blobs/``, and
``refs/<branch or tag>`` with the commit it points at: what ``snapshot_download`` leaves behind and
reads back offline. Tests check the layout with ``huggingface_hub.scan_cache_dir``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

LFS_SUFFIXES = (".safetensors", ".bin", ".model")  # stored through git LFS on the Hub: sha256 etags


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def populate_hub_cache(cache: Path, repo_id: str, files: Path, *, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Copy every file under ``files`` into ``cache`` as ``repo_id`` at ``commit`` (40 hex digits),
    with ``refs`` pointing at it. Returns the snapshot directory."""
    from huggingface_hub.file_download import repo_folder_name

    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    for source in sorted(p for p in files.rglob("*") if p.is_file()):
        relative = source.relative_to(files)
        data = source.read_bytes()
        etag = hashlib.sha256(data).hexdigest() if source.suffix in LFS_SUFFIXES else git_blob_sha1(data)
        blob = repo / "blobs" / etag
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / relative
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        path = repo / "refs" / ref
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot
