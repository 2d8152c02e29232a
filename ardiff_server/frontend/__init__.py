"""The websocket front end (asyncio, no torch).

``server``      the ``websockets`` transport: handshake, routes, write/idle bounds, shutdown
``service``     connections, HTTP routes and limits, transport-free (the Ray ingress runs it too): a frame to its handler
``openpi``      OpenPI's requests: reset and infer, the dict or array reply
``openpi_batch`` OpenPI's ``{"batch": [...]}``: many environments in one frame, each slot its own reply or error
``lingbot_va``  LingBot-VA's own messages (a policy whose ``native_protocol`` it is): reset, infer, compute_kv_cache
``replies``     what every handler shares: server_timing, metrics, error frames, a request's deadline
``latency``     the estimate of a session's next call each reply carries (recent service times per batch size)
``sessions``    SessionTable: ids, reset, detach, TTL, per-session locks (where a session resets), per-key limits
``tls``         wss:// and https:// on the port, certificate reload (SIGHUP)
``auth``        optional API keys
``metrics``     ``GET /metrics``
``signals``     SIGINT/SIGTERM: graceful first, immediate second; SIGHUP: reload the certificate
"""
