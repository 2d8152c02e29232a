"""How the Ray Serve deployment is placed, derived from the config (no Ray needed).

``plan_deployment`` turns ``engine.*`` and ``ray.*`` into replicas, autoscaling bounds and the
GPUs/CPUs each model replica asks Ray for, and refuses combinations that cannot work, naming the
key. ``replica_config`` is the config one model replica's engine runs with.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ardiff_server.config import AppConfig, ConfigError, validate_config

MODEL_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "Ingress"
ROUTING_STATS_PERIOD_S = 1.0  # how often Serve asks each replica for its sessions and KV stats
HEALTH_CHECK_PERIOD_S = 2.0
# What huggingface_hub reads from the environment. Model replicas resolve Hub ids themselves (on whichever node
# they run), so they get the driver's values: a token for gated or private repos, offline mode, the cache.
HUB_ENV_VARS = ("HF_TOKEN", "HF_HUB_OFFLINE", "HF_HOME", "HF_HUB_CACHE", "HF_ENDPOINT")


def hub_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The Hugging Face variables set here (``os.environ`` by default), cache paths made absolute (a replica's
    working directory is Ray's, not this one)."""
    environ = os.environ if environ is None else environ
    out = {name: environ[name] for name in HUB_ENV_VARS if name in environ}
    for name in ("HF_HOME", "HF_HUB_CACHE"):
        if out.get(name):
            out[name] = str(Path(out[name]).expanduser().absolute())
    return out


@dataclass(frozen=True)
class DeploymentPlan:
    """How the model deployment is placed, derived from the config (no Ray needed)."""

    num_replicas: int | None  # fixed count, or None with autoscaling
    min_replicas: int | None
    max_replicas: int | None
    num_gpus: float  # per replica
    num_cpus: float  # per replica
    world_size: int  # engine processes per replica (2: CFG-parallel)
    threads: int  # torch threads per engine process
    max_ongoing_requests: int

    @property
    def autoscaling(self) -> bool:
        return self.num_replicas is None

    @property
    def initial_replicas(self) -> int:
        return self.num_replicas if self.num_replicas is not None else max(1, self.min_replicas or 0)

    @property
    def most_replicas(self) -> int:
        """The most replicas it runs (fixed count or autoscaling maximum): what per-key fair shares divide."""
        return self.num_replicas if self.num_replicas is not None else self.max_replicas

    def describe(self) -> str:
        if self.autoscaling:
            return f"{self.min_replicas}-{self.max_replicas} replicas, autoscaling"
        return f"{self.num_replicas} replica{'s' if self.num_replicas != 1 else ''}"

    def model_options(self, env_vars: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Keyword arguments for the model deployment (``serve.deployment(...).options``); ``env_vars`` (e.g.
        :func:`hub_environment`) go into each replica's ``runtime_env``."""
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_gpus": self.num_gpus, "num_cpus": self.num_cpus},
        }
        if env_vars:
            options["ray_actor_options"]["runtime_env"] = {"env_vars": dict(env_vars)}
        if self.autoscaling:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "initial_replicas": self.initial_replicas,
            }
        else:
            options["num_replicas"] = self.num_replicas
        return options


def uses_cuda(config: AppConfig) -> bool:
    engine = config.engine
    devices = [engine.device, *(engine.devices or []), *(d for ds in engine.replica_devices or [] for d in ds)]
    return any(d.startswith("cuda") for d in devices)


def plan_deployment(config: AppConfig) -> DeploymentPlan:
    """The model deployment's placement (replicas, autoscaling bounds, resources per replica).

    Raises ConfigError naming the key when the combination cannot work."""
    ray_config, engine = config.ray, config.engine
    world = engine.cfg_parallel_size
    cuda = uses_cuda(config)
    num_gpus = ray_config.num_gpus if ray_config.num_gpus is not None else (float(world) if cuda else 0.0)
    if cuda and num_gpus == 0:
        raise ConfigError(f"{config.source}: engine.device is CUDA but ray.num_gpus is 0; set ray.num_gpus (GPUs per replica) or engine.device=cpu")
    if not cuda and num_gpus > 0:
        raise ConfigError(
            f"{config.source}: ray.num_gpus={num_gpus:g} but the engine runs on {engine.device}; set engine.device=cuda (Ray assigns each replica its GPUs)"
        )
    if cuda and world > 1 and 1 <= num_gpus < world:
        raise ConfigError(
            f"{config.source}: engine.cfg_parallel_size={world} needs ray.num_gpus={world} per replica (one GPU per CFG rank), got {num_gpus:g}"
        )
    handshake = config.server.tls_handshake_timeout_s
    if handshake != type(config.server).model_fields["tls_handshake_timeout_s"].default:
        raise ConfigError(
            f"{config.source}: server.tls_handshake_timeout_s={handshake:g} cannot be applied under --ray "
            "(Serve's proxy, uvicorn, has its own handshake timeout); remove it or serve without --ray"
        )
    if ray_config.min_replicas is not None:
        fixed, low, high = None, ray_config.min_replicas, ray_config.max_replicas
    else:
        fixed, low, high = ray_config.num_replicas or engine.replicas, None, None
    threads = engine.threads or max(1, int(ray_config.num_cpus // world))
    return DeploymentPlan(fixed, low, high, float(num_gpus), float(ray_config.num_cpus), world, threads, ray_config.max_ongoing_requests)


def replica_config(config: AppConfig, plan: DeploymentPlan) -> AppConfig:
    """The config one replica's engine runs with. Ray gives each replica its own GPUs through
    ``CUDA_VISIBLE_DEVICES``, so they are ``cuda:0`` (and ``cuda:1`` for the second CFG rank);
    the standalone server's multi-replica device lists do not apply."""
    raw = config.model_dump(mode="json")
    engine = raw["engine"]
    engine.update(replicas=1, replica_devices=None, threads=plan.threads)
    if uses_cuda(config):
        world = plan.world_size
        engine["device"] = "cuda:0"
        engine["devices"] = [f"cuda:{k if plan.num_gpus >= world else 0}" for k in range(world)] if world > 1 else None
    else:
        engine["devices"] = None
    return validate_config(raw, source=config.source)
