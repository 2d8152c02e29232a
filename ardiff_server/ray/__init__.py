"""``ardiff-serve --ray``: the same OpenPI endpoint as a Ray Serve application (docs/deploy.md).

``plan``      replicas and resources per model replica, from the config (no Ray needed)
``proxy``     Serve's HTTP proxy configured for robots (frame limit, no deflate, keepalive)
``replica``   EngineReplica, the model deployment: one engine per replica
``router``    SessionAffinityRouter: each session pinned to its replica (``engine/placement.py``)
``client``    RayEngineClient: the ingress's engine client, calls tagged by session
``ingress``   the ingress deployment: the front end's PolicyService behind Serve's proxy
``run``       build_app / app_builder / run_ray

Session affinity is Ray Serve's own routing: the ingress calls the model deployment with
``handle.options(session_id=...)`` and the router pins each session to the replica that opened
it. When a replica dies Serve starts a new one; the router forgets the dead replica's sessions,
so their next request opens a fresh session elsewhere (``session.new``) and no other session is
touched. Neither torch nor Ray is imported at module level here: the ingress never loads torch.
"""
