"""Typed, validated deploy configuration: YAML files in ``configs/`` plus ``--set`` overrides.

A config has four sections::

    server:  websocket front end (host, port, keys, limits, keepalive, TTLs)
    engine:  the worker: device, dtype, KV budget, session cap, CFG-parallel, warm-up, compile
    policy:  ``name`` picks a registered policy; the rest is validated by that policy's model
    plugins: modules imported first (they may register more policies)

Every error names the file, the dotted key, what was expected and what was given.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml

from policies.registry import policy_entry

CONFIG_DIR = Path(os.environ.get("ARDIFF_CONFIG_DIR", Path(__file__).resolve().parents[1] / "configs"))


class ConfigError(ValueError):
    """A config file or override is invalid; the message says where and why."""


class _Section(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=True)


class ServerConfig(_Section):
    host: str = "127.0.0.1"  # localhost unless told otherwise; 0.0.0.0 for robots on a LAN
    port: int = pydantic.Field(8000, ge=0, le=65535)
    api_keys: list[str] = []  # empty: no authentication
    max_frame_bytes: int = pydantic.Field(64 * 2**20, ge=1024)
    max_connections: int = pydantic.Field(64, ge=1)
    ping_interval_s: float | None = pydantic.Field(20.0, gt=0)  # None disables keepalive pings
    ping_timeout_s: float | None = pydantic.Field(60.0, gt=0)
    request_timeout_s: float = pydantic.Field(300.0, gt=0)  # a stuck worker is restarted after this
    session_ttl_s: float = pydantic.Field(300.0, ge=0)  # a disconnected robot may resume within this
    debug: bool = False  # tracebacks in error frames


class EngineConfig(_Section):
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    cfg_parallel_size: Literal[1, 2] = 1
    devices: list[str] | None = None  # per CFG rank, e.g. [cuda:0, cuda:1]; default: device
    max_sessions: int = pydantic.Field(8, ge=1)  # LRU cap
    kv_budget_gib: float | None = pydantic.Field(None, gt=0)  # None: kv_memory_fraction of free memory
    kv_memory_fraction: float = pydantic.Field(0.5, gt=0, le=1)
    attention_backend: Literal["auto", "sdpa", "flash"] = "auto"
    warmup: bool = True
    compile: bool = False  # torch.compile the DiT blocks (fullgraph)
    compile_backend: str = "inductor"
    cuda_graphs: bool = False  # capture the denoise forward (CUDA only)
    threads: int | None = pydantic.Field(None, ge=1)  # torch intra-op threads per worker
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"
    startup_timeout_s: float = pydantic.Field(900.0, gt=0)

    @pydantic.model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.devices is not None and len(self.devices) != self.cfg_parallel_size:
            raise ValueError(f"devices lists {len(self.devices)} devices for cfg_parallel_size={self.cfg_parallel_size}")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError("cuda_graphs needs a CUDA device")
        if self.cuda_graphs and self.attention_backend == "sdpa":
            raise ValueError("cuda_graphs needs the flash attention backend (sdpa reads lengths on the host)")
        return self

    def rank_device(self, rank: int) -> str:
        return self.devices[rank] if self.devices else self.device


class AppConfig(_Section):
    server: ServerConfig = ServerConfig()
    engine: EngineConfig = EngineConfig()
    policy: dict[str, Any]
    plugins: list[str] = []
    source: str = "<defaults>"  # where it was loaded from, for messages

    @property
    def policy_name(self) -> str:
        return self.policy["name"]

    def policy_options(self) -> pydantic.BaseModel:
        return policy_entry(self.policy_name).config_model().model_validate(self.policy)


def resolve_config_path(name_or_path: str | Path) -> Path:
    """``tiny`` -> ``configs/tiny.yaml``; paths are taken as given."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    named = CONFIG_DIR / f"{name_or_path}.yaml"
    if named.exists():
        return named
    available = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) if CONFIG_DIR.is_dir() else []
    raise ConfigError(f"config {str(name_or_path)!r} not found (a YAML path, or one of {available} in {CONFIG_DIR})")


def load_config(name_or_path: str | Path, overrides: list[str] = ()) -> AppConfig:
    path = resolve_config_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    for override in overrides:
        apply_override(raw, override)
    return validate_config(raw, source=str(path))


def apply_override(raw: dict[str, Any], override: str) -> None:
    """``engine.cfg_parallel_size=2``: the value is parsed as YAML (numbers, bools, lists, null)."""
    key, sep, value = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {override!r}: expected dotted.key=value")
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override!r}: {part} is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {override!r}: cannot parse the value: {exc}") from None


def validate_config(raw: dict[str, Any], source: str = "<config>") -> AppConfig:
    for module in raw.get("plugins") or []:
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise ConfigError(f"{source}: plugins: cannot import {module!r}: {exc}") from None
    try:
        config = AppConfig.model_validate({**raw, "source": source})
    except pydantic.ValidationError as exc:
        raise ConfigError(_describe(source, exc)) from None
    if not isinstance(config.policy.get("name"), str):
        raise ConfigError(f"{source}: policy.name: expected the name of a registered policy (e.g. dreamzero)")
    try:
        config.policy_options()
    except KeyError as exc:
        raise ConfigError(f"{source}: policy.name: {exc.args[0]}") from None
    except pydantic.ValidationError as exc:
        raise ConfigError(_describe(source, exc, prefix="policy")) from None
    return config


def _describe(source: str, exc: pydantic.ValidationError, prefix: str = "") -> str:
    lines = [f"{source}: invalid config"]
    for error in exc.errors():
        where = ".".join(str(p) for p in ((prefix,) if prefix else ()) + tuple(error["loc"]))
        given = error.get("input")
        if error["type"] == "extra_forbidden":
            lines.append(f"  {where}: unknown key")
        elif error["type"] == "missing":
            lines.append(f"  {where}: required")
        else:
            lines.append(f"  {where}: {error['msg']} (got {given!r})")
    return "\n".join(lines)
