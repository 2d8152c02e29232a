"""The engine side of the seam between the websocket front end and the model.

Glossary (one word per idea, in code, messages, metrics, logs and docs):

session         one robot episode's state, named by its session id: the front end's entry
                (``frontend/sessions.py``: who may use it, TTL) and one engine's model state and
                KV pages (``SessionState``, a row of the scheduler's table). A new id is a fresh session.
episode         what a robot does from a fresh session id (or a reset) to the next one.
end             a session ends: ``reset`` on the wire, TTL expiry, eviction (LRU cap, pool
                pressure), a failed step, shutdown. Every ending is ``end`` + a reason
                (``End`` message, ``SessionEngine.end``, ``PagedKVCache.end_session``, the
                ``ardiff_session_endings_total`` metric); its KV pages go back to the pool.
attached        a connection is on the session now (the last request of some open connection).
detach          no connection is on it now: ``switched`` (its robot moved to another id) or
                ``disconnected`` (its last connection closed). A detached (idle) session stays,
                to be resumed, but is evicted first; a disconnected one ends after its TTL.
window restart  the attention window is full: the session drops its pages, keeps its prompt's
                text K/V and re-conditions on the newest frame (reply flag ``window_restart``).
prompt change   a new prompt in a session: the window restarts and the text K/V are re-made
                (reply flag ``prompt_change``); the session (and its id) continues.
replica         one independent engine behind the port (own processes, own KV pool), indexed
                0..N-1 (``engine.replicas``; a Ray Serve model replica).
rank            one CFG-parallel process of a replica: 0 runs the conditional branch, 1 the
                unconditional one. Never a replica index.
page            one latent frame of K and V for every layer: the unit of the KV pool (vLLM's
                "block"). Metrics say pages.
deadline        when a request's robot runs out of actions (``Infer.deadline``, the engine's monotonic
                clock); without one a request is due at its arrival. Replies say the slack left
                when its step started (``deadline_slack_s``; negative: missed).
worker group    one launch of a replica's worker processes; a restart is a new group.

Modules, in the order a request meets them:

``client``          EngineClient: what the front end talks to, and ReplicaStatus
``replicas``        ReplicaSet: several engines, each session pinned to one (``placement``)
``placement``       which replica a new session goes to (pure; also the Ray router's rule)
``process_client``  ProcessClient: an engine in worker processes, its watchdog and restarts
``worker_group``    one launch of worker processes: spawn, Ready handshake, kill, join
``shm``             camera arrays to the worker through shared memory
``channel``         the framing of messages on the socket, both ends
``messages``        typed requests and replies (what crosses a process boundary)
``worker``          the worker process: reader thread -> ``scheduler``; ``loop`` serves; CFG-parallel ranks
``loop``            the one serving loop: the scheduler's rounds, carried out by the engine
``scheduler``       Scheduler: the session table, control first, admission and eviction, deadline order, batches (rounds)
``core``            SessionEngine: each session's model and KV state; carries out the rounds
``encoder``         the encoder thread: session-own work beside the batched steps, each job timed
``builder``         build_engine / start_engine: policy + KV cache + recorder for one rank
``inproc_client``   InprocClient: an engine in this process (tests, scripts, Ray replicas)
``recorder``        session recordings (server.record_dir), decoded and written on their own thread
"""
