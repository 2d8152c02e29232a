"""Reading a DreamZero-DROID checkpoint directory.

Layout (``GEAR-Dreams/DreamZero-DROID``)::

    config.json                        action_head_cfg.config: DiT config + action-head keys
    model.safetensors.index.json       weight_map: tensor name -> shard (or a single model.safetensors)
    model-0000N-of-0000M.safetensors   action_head.{model,text_encoder,image_encoder.model,vae.model}.*
    experiment_cfg/metadata.json       per-embodiment normalization statistics (q01 / q99)
    vae/                               optional, diffusers layout (config.json [+ weights])

Weights stream tensor by tensor from the shards into modules built on the meta device, each
cast to the configured dtype and placed on the configured device as it is read, so the 14B
model never exists twice in memory. Every checkpoint tensor must land somewhere and every
module tensor must be filled: anything else is a :class:`CheckpointError` listing the names.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import safe_open

from ardiff_policies.dreamzero.naming import COMPONENT_PREFIXES, Target
from ardiff_policies.progress import LoadProgress

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """The checkpoint directory is incomplete, corrupted or does not fit the model."""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"missing {path}") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


class WeightFiles:
    """The safetensors shards of a checkpoint: which file holds which tensor, read on demand."""

    def __init__(self, weight_map: dict[str, Path]) -> None:
        self.weight_map = weight_map
        self._handles: dict[Path, Any] = {}
        # a log line per shard as reading reaches it (GiB, GiB/s, time left); DreamZeroModel.load ends it
        shards = {path: path.stat().st_size if path.exists() else 0 for path in set(weight_map.values())}
        self.progress = LoadProgress("weights", shards)

    @classmethod
    def from_directory(cls, directory: Path) -> WeightFiles:
        index = directory / "model.safetensors.index.json"
        if index.exists():
            raw = _read_json(index)
            if not isinstance(raw, dict) or not isinstance(raw.get("weight_map"), dict):
                raise CheckpointError(f"{index}: expected a 'weight_map' object")
            weight_map = {name: directory / shard for name, shard in raw["weight_map"].items()}
            missing_shards = sorted({p.name for p in weight_map.values() if not p.exists()})
            if missing_shards:
                raise CheckpointError(f"{directory}: shards listed in the index are missing: {missing_shards}")
            return cls(weight_map)
        single = directory / "model.safetensors"
        if single.exists():
            return cls.from_files([single])
        raise CheckpointError(f"{directory}: no model.safetensors.index.json or model.safetensors")

    @classmethod
    def from_files(cls, files: Iterable[Path]) -> WeightFiles:
        weight_map: dict[str, Path] = {}
        for path in files:
            for name in _open(path).keys():  # noqa: SIM118 - a safetensors handle, not a dict
                weight_map[name] = Path(path)
        return cls(weight_map)

    def names(self, prefix: str = "") -> list[str]:
        return sorted(name for name in self.weight_map if name.startswith(prefix))

    def get(self, name: str) -> torch.Tensor:
        path = self.weight_map[name]
        if path not in self._handles:
            self._handles[path] = _open(path)
        try:
            tensor = self._handles[path].get_tensor(name)
        except Exception as exc:  # truncated or corrupted shard
            raise CheckpointError(f"{path.name}: cannot read tensor {name!r}: {exc}") from None
        self.progress.read(path, tensor.numel() * tensor.element_size())
        return tensor


def _open(path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None


def load_component(
    module: nn.Module,
    files: WeightFiles,
    prefix: str,
    targets_of: Callable[[str], list[Target]],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
) -> None:
    """Stream every ``prefix*`` tensor into ``module`` (typically built on the meta device).

    Raises :class:`CheckpointError` naming missing, unexpected and mis-shaped tensors.
    """
    device = torch.device(device)
    expected = dict(module.state_dict(keep_vars=True))
    replaced: dict[int, nn.Parameter | torch.Tensor] = {}  # keeps tied parameters tied
    loaded: set[str] = set()
    unexpected: list[str] = []
    mismatched: list[str] = []
    for name in files.names(prefix):
        key = name[len(prefix) :]
        try:
            targets = targets_of(key)
        except KeyError:
            unexpected.append(name)
            continue
        source = files.get(name)
        for target in targets:
            current = expected.get(target.name)
            if current is None:
                unexpected.append(f"{name} (-> {target.name})")
                continue
            value = target.transform(source)
            if tuple(value.shape) != tuple(current.shape):
                mismatched.append(f"{name}: checkpoint {tuple(value.shape)} vs model {tuple(current.shape)}")
                continue
            if id(current) not in replaced:
                cast = value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
                replaced[id(current)] = _assign(module, target.name, cast)
            else:
                _assign(module, target.name, replaced[id(current)])
            loaded.add(target.name)
    missing = sorted(set(expected) - loaded)
    if missing or unexpected or mismatched:
        raise CheckpointError(_describe(prefix, missing, unexpected, mismatched))
    rebuild = getattr(module, "rebuild_buffers", None)
    if rebuild is not None:
        rebuild(device)
    left_on_meta = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left_on_meta:
        raise CheckpointError(f"{prefix}: tensors never materialized (no checkpoint entry): {left_on_meta[:10]}")


def _assign(module: nn.Module, name: str, value: torch.Tensor) -> torch.Tensor:
    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    if leaf in owner._parameters:
        param = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=False)
        owner._parameters[leaf] = param
        return param
    owner._buffers[leaf] = value
    return value


def _describe(prefix: str, missing: list[str], unexpected: list[str], mismatched: list[str]) -> str:
    def head(items: list[str]) -> str:
        shown = ", ".join(items[:12])
        return shown + (f", ... ({len(items)} in all)" if len(items) > 12 else "")

    parts = [f"checkpoint does not fit the model under {prefix!r}:"]
    if missing:
        parts.append(f"missing {len(missing)}: {head(missing)}")
    if unexpected:
        parts.append(f"unexpected {len(unexpected)}: {head(unexpected)}")
    if mismatched:
        parts.append(f"shape mismatch {len(mismatched)}: {head(mismatched)}")
    return "\n  ".join(parts)


# ------------------------------------------------------------------ directory contents


class CheckpointDir:
    """A DreamZero checkpoint directory: its configs, metadata and weight files."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        root = _read_json(self.path / "config.json")
        try:
            self.action_head: dict[str, Any] = root["action_head_cfg"]["config"]
            self.diffusion_model_cfg: dict[str, Any] = self.action_head["diffusion_model_cfg"]
        except (KeyError, TypeError):
            raise CheckpointError(f"{self.path / 'config.json'}: expected action_head_cfg.config.diffusion_model_cfg") from None
        self.root_config = root
        self.metadata: dict[str, Any] = _read_json(self.path / "experiment_cfg" / "metadata.json")
        self.weights = WeightFiles.from_directory(self.path)
        unknown = [n for n in self.weights.weight_map if not n.startswith(COMPONENT_PREFIXES)]
        if unknown:
            raise CheckpointError(f"{self.path}: tensors outside the DreamZero components: {unknown[:12]}")

    def component_config(self, name: str) -> dict[str, Any] | None:
        """Architecture overrides of an encoder (``text_encoder_cfg`` / ``image_encoder_cfg`` /
        ``vae_cfg``) under ``architecture``; None means the released model's defaults."""
        section = self.action_head.get(name) or {}
        arch = section.get("architecture") if isinstance(section, dict) else None
        if arch is None and name == "vae_cfg" and (self.path / "vae" / "config.json").exists():
            arch = {k: v for k, v in _read_json(self.path / "vae" / "config.json").items() if not k.startswith("_")}
        return arch
