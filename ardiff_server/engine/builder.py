"""Building one engine rank from a config: the policy, its KV cache and the recorder.

The one place an engine is built, by the worker process (``worker.py``), a Ray replica, the
benchmarks and tests. :func:`start_engine` is build + torch threads + warm-up, what a process
that serves does; :func:`build_engine` only builds.
"""

from __future__ import annotations

import logging
import os

import torch

from ardiff_kv import PagedKVCache, kv_budget_bytes
from ardiff_kv.storage import device_free_bytes
from ardiff_server.engine.core import SessionEngine

logger = logging.getLogger(__name__)


def start_engine(config, rank: int = 0, world_size: int = 1, control=None, *, warmup: bool) -> SessionEngine:
    """An engine ready to serve in this process: torch threads set, built, warmed up if asked
    (``engine.warmup_ms`` holds the warm-up's timings)."""
    set_threads(config, world_size)
    engine = build_engine(config, rank, world_size, control)
    if warmup:
        engine.warmup()
    return engine


def build_engine(config, rank: int = 0, world_size: int = 1, control=None) -> SessionEngine:
    """Policy and KV cache for one rank, sized from ``config`` (an ``AppConfig``).

    ``world_size`` 2 is CFG-parallel: ``torch.distributed`` must be initialised and ``control``
    is the group the ranks agree on the pool size over.
    """
    import torch.distributed as dist

    from ardiff_policies.base import RuntimeOptions, build_policy
    from ardiff_policies.guidance import Guidance

    engine_config = config.engine
    device = torch.device(engine_config.rank_device(rank))
    if device.type == "cuda":
        if device.index is None:  # "cuda": this process's current device, named explicitly
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    options = RuntimeOptions(
        device=str(device),
        dtype=engine_config.dtype,
        guidance=Guidance.single() if world_size == 1 else Guidance.parallel(rank),
        compile=engine_config.compile,
        compile_backend=engine_config.compile_backend,
        cuda_graphs=engine_config.cuda_graphs,
        record=config.server.record_dir is not None and rank == 0,
        max_sessions=engine_config.max_sessions,
        kv_budget_gib=engine_config.kv_budget_gib,
        kv_memory_fraction=engine_config.kv_memory_fraction,
        max_batch=engine_config.batch_limit,
    )
    policy = build_policy(config.policy_name, config.policy_options(), options)
    if engine_config.modelled_step_time is not None:  # bench only (config.check_bench_only): steps take a GPU's time
        from ardiff_server.engine.modelled_step import ModelledStepPolicy, step_time_profile

        profile = step_time_profile(engine_config.modelled_step_time, engine_config.modelled_step_t1_s)
        logger.warning("bench config: every step lasts at least the modelled %s (%s)", profile.name, profile.formula())
        policy = ModelledStepPolicy(policy, profile)
    max_batch = wanted_batch = engine_config.batch_for(policy.info.max_batch)
    spec = policy.kv_spec()
    cache = None
    if spec is not None:
        most = PagedKVCache.bytes_for_sessions(
            spec, max_sessions=engine_config.max_sessions, num_branches=len(policy.branches), max_batch=wanted_batch
        )
        budget = kv_budget_bytes(engine_config.kv_budget_gib, engine_config.kv_memory_fraction, device_free_bytes(device), most=most)
        if world_size > 1:  # both ranks must make the same batching and admission decisions: agree on the budget
            agreed = torch.tensor([budget], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=control)
            budget = int(agreed)
        cache = PagedKVCache.from_budget(
            spec,
            budget,
            max_sessions=engine_config.max_sessions,
            branches=policy.branches,
            device=device,
            attention_backend=engine_config.attention_backend,
            max_batch=wanted_batch,
        )
        max_batch = cache.storage.max_batch  # fewer if the pool cannot hold wanted_batch sessions at once
        if max_batch < wanted_batch:
            logger.warning(
                "engine.max_batch %d -> %d: the KV pool holds %d session(s) at once, and a batch only runs if all its members fit "
                "(a larger engine.kv_budget_gib / kv_memory_fraction, or fewer branches per GPU, batches more)",
                wanted_batch,
                max_batch,
                max_batch,
            )
        logger.info(
            "KV cache: %d pages of %d tokens (%.1f MiB each), %d sessions, branches %s, scratch for %d per forward, %.1f MiB in all",
            cache.pool.capacity,
            spec.page_size,
            spec.page_bytes / 2**20,
            cache.session_capacity,
            [b.name for b in policy.branches],
            max_batch,
            cache.storage.nbytes / 2**20,
        )
    recorder = None
    if options.record:
        from ardiff_server.engine.recorder import Recorder

        recorder = Recorder(config.server.record_dir, max_bytes=int(config.server.record_max_gib * 2**30), decode=policy.decode_prediction)
    # A compiled forward (engine.compile, the flex kernel) is a graph per batch shape: warm-up walks them all.
    compiled = engine_config.compile or engine_config.attention_backend == "flex"
    return SessionEngine(
        policy,
        cache,
        max_sessions=engine_config.max_sessions,
        max_batch=max_batch,
        batch_wait_s=engine_config.batch_wait_s,
        schedule=engine_config.schedule,
        rank=rank,
        recorder=recorder,
        warmup_batches=max_batch if compiled else 1,
    )


def set_threads(config, world_size: int) -> None:
    """torch intra-op threads for this engine: ``engine.threads``, else the cores split evenly."""
    processes = world_size * max(1, config.engine.replicas)
    torch.set_num_threads(config.engine.threads or max(1, (os.cpu_count() or 1) // processes))
