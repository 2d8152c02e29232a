"""Policies by name: where each one's config model and builder live (torch-free).

The front end validates ``policy:`` sections without loading a model, so the registry holds
import paths: ``config`` points into a torch-free module (a pydantic model), ``build`` into the
policy module the worker imports. Plugins (``plugins:`` in a config) register more policies,
by path or with the objects themselves (:func:`register_policy`, also as a decorator).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic


@dataclass(frozen=True)
class PolicyEntry:
    config: str | type[pydantic.BaseModel]  # "module:Class" or the class
    build: str | Callable[..., Any]  # "module:function(config, RuntimeOptions) -> Policy" or the function

    def config_model(self) -> type[pydantic.BaseModel]:
        return _resolve(self.config)

    def builder(self) -> Callable[..., Any]:
        return _resolve(self.build)


_REGISTRY: dict[str, PolicyEntry] = {
    "dreamzero": PolicyEntry("ardiff_policies.dreamzero.config:DreamZeroConfig", "ardiff_policies.dreamzero.policy:build_dreamzero"),
    "lingbot_va": PolicyEntry("ardiff_policies.lingbot_va.config:LingBotVAConfig", "ardiff_policies.lingbot_va.policy:build_lingbot_va"),
    "zero_wam": PolicyEntry(
        "ardiff_policies.lingbot_va.zero_wam_config:ZeroWAMPolicyConfig", "ardiff_policies.lingbot_va.zero_wam_policy:build_zero_wam"
    ),
    "noop": PolicyEntry("ardiff_policies.noop.config:NoopConfig", "ardiff_policies.noop.policy:build_noop"),
}


def register_policy(name: str, config: str | type[pydantic.BaseModel], build: str | Callable[..., Any] | None = None) -> Any:
    """Register a policy: ``register_policy("mine", "pkg.config:MyConfig", "pkg.policy:build")``, or as a
    decorator of its builder, ``@register_policy("mine", MyConfig) def build(config, options) -> Policy``."""
    if build is not None:
        _REGISTRY[name] = PolicyEntry(config, build)
        return None

    def decorator(builder: Callable[..., Any]) -> Callable[..., Any]:
        _REGISTRY[name] = PolicyEntry(config, builder)
        return builder

    return decorator


def policy_entry(name: str) -> PolicyEntry:
    if name not in _REGISTRY:
        raise KeyError(f"unknown policy {name!r}; available: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def _resolve(target: Any) -> Any:
    if not isinstance(target, str):
        return target
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)
