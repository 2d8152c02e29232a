"""Typed, validated deploy configuration: YAML files in ``configs/`` plus ``--set`` overrides.

A config has five sections::

    server:  websocket front end (host, port, TLS, keys, per-key limits, keepalive, TTLs, reply format)
    engine:  the workers: device(s), dtype, KV budget, session cap, CFG-parallel, replicas, warm-up
    policy:  ``name`` picks a registered policy; the rest is validated by that policy's model
    ray:     the Ray Serve deployment (``ardiff-serve --ray``)
    plugins: modules imported first (they may register more policies)

Every error names the file, the dotted key, what was expected and what was given. Nothing here
imports torch: configs are validated (and bad ones refused) before any worker is spawned.
"""

from __future__ import annotations

import ctypes
import difflib
import importlib
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic
import yaml

from ardiff_policies.registry import policy_entry
from ardiff_server.extras import install_hint
from ardiff_server.net import TlsError, server_tls_context

CONFIG_DIR = Path(os.environ.get("ARDIFF_CONFIG_DIR", Path(__file__).resolve().parents[1] / "configs"))


class ConfigError(ValueError):
    """A config file or override is invalid; the message says where and why."""


class _Section(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=True)


class ServerConfig(_Section):
    host: str = "127.0.0.1"  # localhost unless told otherwise; 0.0.0.0 for robots on a LAN
    port: int = pydantic.Field(8000, ge=0, le=65535)  # 0 picks a free port (printed in the "listening on" line)
    api_keys: list[str] = []  # empty: no authentication
    reply_format: Literal["dict", "array"] = "dict"  # array: the bare (N, 8) actions, as DreamZero's server
    max_frame_bytes: int = pydantic.Field(64 * 2**20, ge=1024)  # larger frames are refused before they are read (close 1009)
    # permessage-deflate: declined unless set (a 338 KiB observation frame costs ~10x the CPU time of sending it plainly)
    compression: Literal["none", "deflate"] = "none"
    max_frame_items: int = pydantic.Field(1024, ge=64)  # msgpack list/map entries per frame (DROID: < 100)
    # Camera pixels one request may declare (JPEG headers, raw array shapes, after the frames the policy drops),
    # refused by name before any is decoded; auto: the policy's frames per call x cameras at 4x its resolution per side
    max_request_pixels: int | Literal["auto"] = "auto"
    # Requests one {"batch": [...]} frame may carry (openpi PR #941; each element its own session and pixel budget);
    # auto: the sessions the server holds (engine.max_sessions x replicas): a larger batch could not all be served
    max_batch_elements: int | Literal["auto"] = "auto"
    max_connections: int = pydantic.Field(64, ge=1)  # further handshakes get HTTP 503
    # Per API key (frontend/sessions.py, "Per-key limits" in docs/design-notes.md). "fair": with two or
    # more keys, an equal share of engine.max_sessions x replicas (of max_connections); else no limit.
    max_sessions_per_key: int | Literal["fair"] | None = "fair"
    max_connections_per_key: int | Literal["fair"] | None = (
        "fair"  # per API key: a count, "fair" (a share of max_connections with two or more keys) or null
    )
    tls_cert: str | None = None  # PEM chain (fullchain.pem): serve wss:// and https:// on the port
    tls_key: str | None = None  # PEM key (privkey.pem); None: it is in tls_cert
    tls_handshake_timeout_s: float = pydantic.Field(10.0, gt=0)  # a plain or stalled client is dropped after this
    ping_interval_s: float | None = pydantic.Field(20.0, gt=0)  # None disables keepalive pings
    ping_timeout_s: float | None = pydantic.Field(60.0, gt=0)  # a connection that does not answer a ping this long is closed
    write_limit_bytes: int = pydantic.Field(16 * 2**20, ge=2**16)  # unsent bytes one connection may pile up
    idle_timeout_s: float | None = pydantic.Field(600.0, gt=0)  # close connections with no request this long
    request_timeout_s: float = pydantic.Field(300.0, gt=0)  # one step's compute per session in it; past it the worker is restarted
    session_ttl_s: float = pydantic.Field(300.0, ge=0)  # a session nobody uses lives this long
    shutdown_grace_s: float = pydantic.Field(3.0, ge=0)  # SIGTERM: how long the worker may finish its step
    record_dir: str | None = None  # per-session recordings (rollout.mp4, actions.npz, ...); needs the viz extra
    record_max_gib: float = pydantic.Field(10.0, gt=0)  # oldest recordings are pruned past this
    debug: bool = False  # tracebacks in error frames

    @pydantic.field_validator("api_keys")
    @classmethod
    def _keys_are_real(cls, keys: list[str]) -> list[str]:
        for index, key in enumerate(keys):
            if not key.strip():
                raise ValueError(f"api_keys[{index}] is empty: an unset variable would turn authentication off")
            if key != key.strip() or any(c.isspace() for c in key):
                raise ValueError(f"api_keys[{index}] contains whitespace")
        return keys

    @pydantic.field_validator("max_sessions_per_key", "max_connections_per_key", mode="before")
    @classmethod
    def _per_key_limit(cls, value: Any) -> Any:
        if value is None or value == "fair" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError("expected a count >= 1, fair (a share per key) or null (no limit)")

    @pydantic.field_validator("max_batch_elements", mode="before")
    @classmethod
    def _batch_elements(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError("expected a number of requests >= 1 or auto (engine.max_sessions x replicas)")

    @pydantic.field_validator("max_request_pixels", mode="before")
    @classmethod
    def _pixel_budget(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError("expected a number of pixels >= 1 (e.g. 11059200: 4 frames x 3 cameras of 720x1280) or auto")

    @pydantic.model_validator(mode="after")
    def _tls_pair(self) -> ServerConfig:
        if self.tls_key is not None and self.tls_cert is None:
            raise ValueError("tls_key is set without tls_cert: give the certificate chain too (--tls-cert)")
        return self

    @property
    def scheme(self) -> str:
        return "wss" if self.tls_cert is not None else "ws"


# A torch device string the engine can be given: cpu, cuda (this process's current GPU) or cuda:N.
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_DEVICE_EXPECTED = "expected cpu, cuda or cuda:<index>"


class EngineConfig(_Section):
    device: str = "cpu"  # cpu, cuda (replicas and CFG ranks on consecutive GPUs) or cuda:N
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # bfloat16 on GPU (the released checkpoints' precision)
    cfg_parallel_size: Literal[1, 2] = 1  # 2: one CFG branch per rank and GPU (gloo on CPU, NCCL on GPU)
    devices: list[str] | None = None  # per CFG rank, e.g. [cuda:0, cuda:1]; default: device
    max_sessions: int = pydantic.Field(8, ge=1)  # sessions per replica; a new one takes only an idle session's place, never one a robot is on
    max_batch: int = pydantic.Field(4, ge=1, le=64)  # sessions per forward when several robots' requests wait together
    batch_wait_ms: float = pydantic.Field(0.0, ge=0, le=1000)  # how long a partial batch waits for more (0: only what is queued)
    schedule: Literal["deadline", "arrival"] = (
        "deadline"  # which waiting request runs first: deadline (the earliest robot to run out of actions; no deadline: due at arrival), arrival (first come, first served)
    )
    kv_budget_gib: float | None = pydantic.Field(
        None, gt=0
    )  # GiB for the KV pool per rank; null: kv_memory_fraction of the free memory (set it when two servers share a GPU)
    kv_memory_fraction: float = pydantic.Field(
        0.5, gt=0, le=1
    )  # of the memory free after loading the model, for the KV pool (configs/dreamzero_droid*: 0.8 / 0.75)
    attention_backend: Literal["auto", "sdpa", "flash", "flex"] = (
        "auto"  # sdpa (gather, CPU/GPU), flash (vLLM's block-table kernel: the gpu extra), flex (FlexAttention); auto: flash where installed, else sdpa
    )
    warmup: bool = True  # walk one full window + restart before serving (a restart after a crash skips it unless compiling)
    compile: bool = False  # torch.compile the DiT blocks (fullgraph)
    compile_backend: str = "inductor"  # torch.compile backend with compile: true (inductor; aot_eager to debug)
    cuda_graphs: bool = False  # capture the denoise forward (CUDA only)
    threads: int | None = pydantic.Field(None, ge=1)  # torch intra-op threads per worker
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"  # CFG-parallel transport; auto: NCCL on CUDA, gloo on CPU
    startup_timeout_s: float = pydantic.Field(900.0, gt=0)  # load + compile + warm-up per worker; raise it for a cold 14B load from a slow disk
    replicas: int = pydantic.Field(1, ge=1)  # independent engines behind one port (sessions stay on theirs)
    replica_devices: list[list[str]] | None = None  # per replica, one device per CFG rank
    shm_mib: int = pydantic.Field(128, ge=0)  # shared memory for camera frames per replica (0: through the pipe)
    # Bench only (needs bench: true): every batched step of b sessions lasts at least t(b) of a GPU profile,
    # 14b (b x 0.61 s) or 5b (0.15 s x (1 + 0.1 (b - 1))) at 16 denoising steps, scaled to the steps its calls ran,
    # sleeping after the real step (engine/modelled_step.py)
    modelled_step_time: Literal["14b", "5b"] | None = None
    modelled_step_t1_s: float | None = pydantic.Field(None, gt=0)  # replaces the profile's t(1) (needs modelled_step_time)

    @pydantic.field_validator("device")
    @classmethod
    def _one_device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(_DEVICE_EXPECTED)
        return value

    @pydantic.field_validator("devices", "replica_devices")
    @classmethod
    def _device_lists(cls, value: list | None) -> list | None:
        for device in _flatten(value or []):
            if not _DEVICE.match(device):
                raise ValueError(f"{_DEVICE_EXPECTED}, got {device!r}")
        return value

    @pydantic.model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.devices is not None and len(self.devices) != self.cfg_parallel_size:
            raise ValueError(f"devices lists {len(self.devices)} devices for cfg_parallel_size={self.cfg_parallel_size}")
        if self.replica_devices is not None:
            if len(self.replica_devices) != self.replicas:
                raise ValueError(f"replica_devices lists {len(self.replica_devices)} replicas for replicas={self.replicas}")
            for index, devices in enumerate(self.replica_devices):
                if len(devices) != self.cfg_parallel_size:
                    raise ValueError(f"replica_devices[{index}] lists {len(devices)} devices for cfg_parallel_size={self.cfg_parallel_size}")
        on_cpu = [d for devices in self.replica_device_lists_unchecked() for d in devices if not d.startswith("cuda")]
        if self.attention_backend == "flash" and on_cpu:
            raise ValueError(f"attention_backend flash (vLLM's paged flash-attention) needs CUDA devices, got {on_cpu[0]}; use auto or sdpa")
        if self.dist_backend == "nccl" and on_cpu:
            raise ValueError(f"dist_backend nccl needs CUDA devices, got {on_cpu[0]}; use auto (gloo on the CPU)")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError("cuda_graphs needs a CUDA device")
        if self.cuda_graphs and self.attention_backend not in ("flash", "flex"):
            # auto would fall back to sdpa without vLLM, and capture would then quietly run eagerly
            raise ValueError("cuda_graphs needs attention_backend flash (vLLM) or flex (sdpa reads lengths on the host)")
        return self

    @property
    def batch_limit(self) -> int:
        """Sessions one forward may hold: ``max_batch``, never more than the session table holds."""
        return min(self.max_batch, self.max_sessions)

    def batch_for(self, policy_max_batch: int) -> int:
        """Sessions one engine step holds: :attr:`batch_limit`, never more than the policy can batch
        in one forward (``PolicyInfo.max_batch``)."""
        return min(self.batch_limit, policy_max_batch)

    @property
    def batch_wait_s(self) -> float:
        return self.batch_wait_ms / 1000.0

    def rank_device(self, rank: int) -> str:
        return self.devices[rank] if self.devices else self.device

    def replica_device_lists_unchecked(self) -> list[list[str]]:
        """Every device a rank may run on, without :meth:`replica_device_lists`' check of the spread."""
        if self.replica_devices is not None:
            return [list(devices) for devices in self.replica_devices]
        return [self.devices or [self.device]]

    def replica_device_lists(self) -> list[list[str]]:
        """Devices of each replica, one per CFG rank. Default: ``cuda`` (no index) spreads replicas
        and ranks over consecutive GPUs (8 GPUs, cfg_parallel_size 2: 4 pairs); anything else is
        shared by every replica (``cpu``) or taken from ``devices``."""
        if self.replica_devices is not None:
            return [list(devices) for devices in self.replica_devices]
        ranks = self.cfg_parallel_size
        if (self.replicas > 1 or ranks > 1) and self.devices is None and self.device == "cuda":
            return [[f"cuda:{r * ranks + k}" for k in range(ranks)] for r in range(self.replicas)]
        if self.replicas > 1 and self.device.startswith("cuda"):
            example = [[f"cuda:{r * ranks + k}" for k in range(ranks)] for r in range(2)]
            listed = "[" + ", ".join("[" + ",".join(d) + "]" for d in example) + ", ...]"
            spread = (
                "--set engine.devices=null (engine.device: cuda then spreads them"
                if self.devices is not None
                else ("--set engine.device=cuda (to spread them")
            )
            what = (
                f"engine.devices pins one replica's {ranks} rank(s) to {self.devices}"
                if self.devices is not None
                else (f"engine.device {self.device} is one GPU")
            )
            raise ValueError(
                f"engine.replicas={self.replicas} on CUDA, but {what}: {spread} over consecutive GPUs, "
                f"{ranks} per replica) or give each replica its own with --set 'engine.replica_devices={listed}'"
            )
        return [[self.rank_device(k) for k in range(ranks)] for _ in range(self.replicas)]


def _flatten(items: list) -> list[str]:
    return [leaf for item in items for leaf in (_flatten(item) if isinstance(item, list) else [item])]


class RayConfig(_Section):
    """``ardiff-serve --ray``: the same endpoint as a Ray Serve application (see docs/deploy.md)."""

    address: str | None = None  # a running cluster ("auto", "ray://host:10001"); None starts a local one
    num_replicas: int | None = pydantic.Field(None, ge=1)  # fixed count; default: engine.replicas
    min_replicas: int | None = pydantic.Field(None, ge=0)  # autoscaling bounds (both or neither)
    max_replicas: int | None = pydantic.Field(None, ge=1)  # autoscaling upper bound
    num_gpus: float | None = pydantic.Field(None, ge=0)  # per model replica; default: cfg_parallel_size on CUDA, else 0
    num_cpus: float = pydantic.Field(1.0, gt=0)  # per model replica
    max_ongoing_requests: int = pydantic.Field(64, ge=1)  # per replica; one step runs at a time regardless
    app_name: str = "ardiff"  # the Serve application's name (serve status, serve delete)

    @pydantic.model_validator(mode="after")
    def _check(self) -> RayConfig:
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("set both min_replicas and max_replicas (autoscaling) or neither")
        if self.min_replicas is not None and self.max_replicas < max(1, self.min_replicas):
            raise ValueError(f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas}) and >= 1")
        if self.min_replicas is not None and self.num_replicas is not None:
            raise ValueError("num_replicas and min/max_replicas exclude each other")
        return self


class AppConfig(_Section):
    server: ServerConfig = ServerConfig()
    engine: EngineConfig = EngineConfig()
    policy: dict[str, Any]
    ray: RayConfig = RayConfig()
    plugins: list[str] = []
    bench: bool = False  # a benchmark's config (scripts/bench_fleet.py): bench-only options allowed; never serve robots with one
    source: str = "<defaults>"  # where it was loaded from, for messages

    def public(self) -> dict[str, Any]:
        """The effective config without secrets (``GET /info``)."""
        data = self.model_dump(mode="json")
        data["server"]["api_keys"] = f"<{len(self.server.api_keys)} key(s)>"
        return data

    def sessions_per_key(self, replicas: int | None = None) -> int | None:
        """``server.max_sessions_per_key`` in effect: "fair" is an equal share of the engine's
        sessions (``engine.max_sessions`` x replicas, at least 1) among two or more keys.
        ``replicas``: the engine replicas serving (default ``engine.replicas``; on Ray Serve the
        deployment's count, or its autoscaling maximum)."""
        return self._per_key(self.server.max_sessions_per_key, self.engine.max_sessions * (replicas or self.engine.replicas))

    def batch_elements(self, replicas: int | None = None) -> int:
        """``server.max_batch_elements`` in effect: "auto" is the sessions the server holds (``engine.max_sessions`` x
        replicas; ``replicas`` as for :meth:`sessions_per_key`)."""
        setting = self.server.max_batch_elements
        return self.engine.max_sessions * (replicas or self.engine.replicas) if setting == "auto" else setting

    def connections_per_key(self) -> int | None:
        """``server.max_connections_per_key`` in effect ("fair": a share of ``server.max_connections``)."""
        return self._per_key(self.server.max_connections_per_key, self.server.max_connections)

    def _per_key(self, setting: int | str | None, total: int) -> int | None:
        return fair_share(total, len(set(self.server.api_keys))) if setting == "fair" else setting

    @property
    def policy_name(self) -> str:
        return self.policy["name"]

    def policy_options(self) -> pydantic.BaseModel:
        return policy_entry(self.policy_name).config_model().model_validate(self.policy)


def fair_share(total: int, keys: int) -> int | None:
    """A key's share of ``total`` (sessions, connections) under a ``fair`` per-key limit: an equal
    share, at least 1, among two or more keys; None (no limit) with one key or none. The one rule
    for what ``/info`` reports and what the session table enforces (``frontend/sessions.py``)."""
    return max(1, total // keys) if keys > 1 else None


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


def load_config(name_or_path: str | Path, overrides: Sequence[str] = (), *, flags: Sequence[tuple[str, str]] = ()) -> AppConfig:
    """The file, then each ``--set`` override, then ``flags``: (override, the command-line flag it
    came from, e.g. ``("server.port=70000", "--port 70000")``). An error in a value that came from
    the command line says which ``--set`` or flag gave it."""
    path = resolve_config_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    origins: dict[str, str] = {}
    for override in overrides:
        key = apply_override(raw, override)
        origins[key] = f"--set {_redacted(key, override)}"
    for override, flag in flags:
        origins[apply_override(raw, override)] = flag
    return validate_config(raw, source=str(path), origins=origins)


def apply_override(raw: dict[str, Any], override: str) -> str:
    """``engine.cfg_parallel_size=2``: the value is parsed as YAML (numbers, bools, lists, null).
    Returns the dotted key."""
    key, sep, value = override.partition("=")
    if not sep or not key.strip():
        example = f" (e.g. --set {key.strip() or 'engine.max_sessions'}=VALUE)"
        raise ConfigError(f"--set {override!r}: expected dotted.key=value{example}")
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
    return ".".join(parts)


def _redacted(key: str, override: str) -> str:
    """An override as it may be printed: API keys' values never are."""
    return f"{key}=<hidden>" if key.rsplit(".", 1)[-1] == "api_keys" else override


def validate_config(raw: dict[str, Any], source: str = "<config>", origins: Mapping[str, str] | None = None) -> AppConfig:
    """``origins``: dotted key -> the command-line override that set it (named in errors)."""
    plugins = raw.get("plugins") or []
    if not isinstance(plugins, list) or not all(isinstance(module, str) for module in plugins):
        raise ConfigError(f"{source}: plugins: expected a list of module names (e.g. [my_lab.policies]), got {plugins!r}")
    for module in plugins:
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise ConfigError(f"{source}: plugins: cannot import {module!r}: {exc}") from None
    try:
        config = AppConfig.model_validate({**raw, "source": source})
    except pydantic.ValidationError as exc:
        raise ConfigError(_describe(source, exc, model=AppConfig, origins=origins)) from None
    if not isinstance(config.policy.get("name"), str):
        raise ConfigError(f"{source}: policy.name: expected the name of a registered policy (e.g. dreamzero)")
    check_bench_only(config, origins or {})
    try:
        options = config.policy_options()
    except KeyError as exc:
        raise ConfigError(f"{source}: policy.name: {exc.args[0]}") from None
    except pydantic.ValidationError as exc:
        model = policy_entry(config.policy_name).config_model()
        raise ConfigError(_describe(source, exc, prefix="policy", model=model, origins=origins)) from None
    safety = getattr(options, "safety", None)
    if safety is not None and safety.mode == "clamp" and config.server.reply_format == "array":  # (ardiff_policies.safety)
        raise ConfigError(
            f"{source}: policy.safety.mode: clamp must say so in the reply, which server.reply_format array (bare actions) cannot; "
            "use reply_format dict, or mode reject (its error is a text frame)"
        )
    return config


def check_bench_only(config: AppConfig, origins: Mapping[str, str]) -> None:
    """Options that make a server wrong on purpose (a modelled step time) only where the config says ``bench: true``."""
    engine = config.engine
    if engine.modelled_step_t1_s is not None and engine.modelled_step_time is None:
        raise ConfigError(
            f"{config.source}: engine.modelled_step_t1_s{_origin('engine.modelled_step_t1_s', origins)} needs engine.modelled_step_time "
            f"(14b or 5b), whose t(1) it replaces"
        )
    if engine.modelled_step_time is not None and not config.bench:
        raise ConfigError(
            f"{config.source}: engine.modelled_step_time{_origin('engine.modelled_step_time', origins)} is bench-only (every step "
            f"sleeps to a modelled GPU time): remove it to serve robots, or set bench: true in a benchmark's config"
        )


def preflight(config: AppConfig, *, local: bool = True) -> None:
    """What would make every worker fail, checked before any is spawned (no torch needed):
    devices that are not there, and the policy's own files (checkpoint, tokenizer). A policy's
    ``preflight()`` may return its config with files resolved (Hugging Face ids fetched into the
    hub cache): the workers get that one. Raises ConfigError with one line naming the problem and the fix. ``local=False`` (Ray Serve: the
    engines run on other nodes) checks only what does not depend on this machine."""
    try:
        device_lists = config.engine.replica_device_lists()
    except ValueError as exc:
        raise ConfigError(f"{config.source}: {exc}") from None
    for devices in device_lists:
        shared = sorted({d for d in devices if d.startswith("cuda") and devices.count(d) > 1})
        if shared:
            raise ConfigError(
                f"{config.source}: engine.cfg_parallel_size={len(devices)} puts {devices.count(shared[0])} CFG ranks on {shared[0]} "
                f"(each loads the whole model); give each rank its GPU: --set 'engine.devices=[cuda:0,cuda:1]'"
            )
    for name in ("max_sessions_per_key", "max_connections_per_key"):
        value = getattr(config.server, name)
        if isinstance(value, int) and not config.server.api_keys:
            raise ConfigError(
                f"server.{name}: {value} needs API keys, which it counts by (--api-key-file, ARDIFF_API_KEYS or server.api_keys); "
                f"without keys use engine.max_sessions / server.max_connections"
            )
    if not local:
        return
    if config.server.tls_cert is not None:
        check_tls(config)
    wanted = sorted({d for devices in device_lists for d in devices if d.startswith("cuda")})
    # a CPU torch on a GPU machine (the CPU .venv on a GPU box): said before any hub download, with --gpu as the fix
    cpu_torch = installed_torch_is_cpu_build()
    count = cuda_device_count() if wanted or cpu_torch else 0  # the driver asked once
    gpus_unusable = count if cpu_torch else 0
    if wanted and gpus_unusable:
        raise ConfigError(
            f"{config.source}: engine device {wanted[0]}: this machine has {gpus_unusable} CUDA device(s) but torch "
            f"{_torch_version()} in {sys.prefix} is a CPU build; serve from the GPU install: bash scripts/serve.sh --gpu ... (.venv-gpu)"
        )
    if not wanted and gpus_unusable:
        logging.getLogger("ardiff_server").info(
            "this machine has %d CUDA device(s) and torch %s here is a CPU build: serving on the CPU; "
            "bash scripts/serve.sh --gpu serves a GPU config from .venv-gpu",
            gpus_unusable,
            _torch_version(),
        )
    if wanted:
        for device in wanted:
            index = int(device.partition(":")[2] or 0)
            if index >= count:
                have = f"{count} CUDA device(s)" if count else "no CUDA device"
                on_cpu = "--set engine.device=cpu" + "".join(
                    f" --set engine.{key}=null" for key in ("devices", "replica_devices") if getattr(config.engine, key) is not None
                )
                # what only CUDA has goes too (each is refused on the CPU with its own line otherwise)
                on_cpu += " --set engine.dist_backend=auto" if config.engine.dist_backend == "nccl" else ""
                on_cpu += " --set engine.attention_backend=auto" if config.engine.attention_backend == "flash" else ""
                raise ConfigError(f"{config.source}: engine device {device}: this machine has {have}; serve {_cpu_twin(config)} or {on_cpu}")
    if config.server.record_dir is not None:
        missing = [name for name in ("av", "matplotlib", "PIL") if importlib.util.find_spec(name) is None]
        if missing:
            raise ConfigError(f"server.record_dir needs {', '.join(missing)}: {install_hint('viz')}")
        try:
            Path(config.server.record_dir).expanduser().mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"server.record_dir: cannot create {config.server.record_dir}: {exc.strerror}") from None
        logging.getLogger("ardiff_server").info(
            "recording every session to %s/<session id>/ (oldest pruned past server.record_max_gib %g GiB)",
            Path(config.server.record_dir).expanduser().resolve(),
            config.server.record_max_gib,
        )
    check = getattr(config.policy_options(), "preflight", None)
    if check is not None:
        try:
            resolved = check()
        except ValueError as exc:
            raise ConfigError(f"{config.source}: {exc}") from None
        if isinstance(resolved, pydantic.BaseModel):  # e.g. Hugging Face ids resolved to local snapshots
            config.policy = resolved.model_dump(mode="json")


def check_tls(config: AppConfig) -> None:
    """Load ``server.tls_cert``/``tls_key`` as the server will; ConfigError (one line) if it cannot."""
    try:
        server_tls_context(config.server.tls_cert, config.server.tls_key)
    except TlsError as exc:
        raise ConfigError(str(exc)) from None


# Each family's CPU twin: what a machine without the GPU a config wants can serve instead.
_CPU_TWINS = {"dreamzero": "tiny", "lingbot_va": "tiny_lingbot_va", "zero_wam": "tiny_zero_wam"}
# Where a family's embodiments differ in cameras and chunking, the twin of that embodiment.
_CPU_TWINS_BY_EMBODIMENT = {("lingbot_va", "libero"): "tiny_lingbot_va_libero", ("lingbot_va", "tiny_libero"): "tiny_lingbot_va_libero"}


def _cpu_twin(config: AppConfig) -> str:
    family = config.policy.get("name")
    twin = _CPU_TWINS_BY_EMBODIMENT.get((family, config.policy.get("embodiment"))) or _CPU_TWINS.get(family, "tiny")
    return f"its tiny CPU twin (--config {twin})"


def installed_torch_is_cpu_build() -> bool:
    """Whether the torch this process would import has no CUDA library (found on disk: torch is not imported)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    return not any(Path(spec.origin).parent.joinpath("lib").glob("libtorch_cuda*"))


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown)"


def cuda_device_count() -> int:
    """CUDA devices visible to this process, from the driver library (no torch, no context)."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def _describe(
    source: str,
    exc: pydantic.ValidationError,
    prefix: str = "",
    *,
    model: type[pydantic.BaseModel] | None = None,
    origins: Mapping[str, str] | None = None,
) -> str:
    lines = [f"{source}: invalid config"]
    for error in exc.errors():
        where = ".".join(str(p) for p in ((prefix,) if prefix else ()) + tuple(error["loc"]))
        given = error.get("input")
        if error["type"] == "extra_forbidden":
            line = f"  {where}: unknown key"
        elif error["type"] == "missing":
            line = f"  {where}: required"
        elif isinstance(given, dict) or "api_keys" in error["loc"]:  # a whole section, or secrets: not echoed
            line = f"  {where}: {error['msg']}"
        else:
            line = f"  {where}: {error['msg']} (got {given!r})"
        line += _origin(where, origins or {})
        if error["type"] == "extra_forbidden" and model is not None:
            line += _nearest_key(model, error["loc"], prefix)
        lines.append(line)
    return "\n".join(lines)


def _origin(where: str, origins: Mapping[str, str]) -> str:
    """`` (from --set KEY=VALUE)`` when the command line set ``where``, a key under it or a section above it."""
    named = [flag for key, flag in origins.items() if key == where or key.startswith(f"{where}.") or where.startswith(f"{key}.")]
    return f" (from {', '.join(named)})" if named else ""


def _nearest_key(model: type[pydantic.BaseModel], loc: tuple, prefix: str) -> str:
    """``; did you mean engine.max_sessions?`` for the known key closest to an unknown one (difflib)."""
    *section, name = loc
    known = _keys_at(model, section)
    match = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
    if not match:
        return ""
    return f"; did you mean {'.'.join(str(p) for p in ((prefix,) if prefix else ()) + tuple(section) + (match[0],))}?"


def _keys_at(model: type[pydantic.BaseModel], path: Sequence[Any]) -> list[str]:
    """The keys a config model takes at ``path`` (list indices step into the list's item model)."""
    for part in path:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        inner = _model_in(field.annotation) if field is not None else None
        if inner is None:
            return []
        model = inner
    return [field.alias or name for name, field in model.model_fields.items() if name != "source"]


def _model_in(annotation: Any) -> type[pydantic.BaseModel] | None:
    """The config model an annotation holds (``Model``, ``Model | None``, ``list[Model]``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
