"""The websocket front end (asyncio, no torch).

``server``    the ``websockets`` transport: handshake, routes, write/idle bounds, shutdown
``service``   the OpenPI protocol and session rules, transport-free (the Ray ingress runs it too)
``sessions``  SessionTable: ids, reset, detach, TTL, per-session locks (where a session resets), per-key limits
``tls``       wss:// and https:// on the port, certificate reload (SIGHUP)
``auth``      optional API keys
``metrics``   ``GET /metrics``
``signals``   SIGINT/SIGTERM: graceful first, immediate second; SIGHUP: reload the certificate
"""
