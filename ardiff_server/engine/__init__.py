"""The engine side of the seam between the websocket front end and the model.

``messages``  typed requests and replies (what crosses a process boundary)
``core``      SessionEngine: the session table with each session's model and KV state;
              build_engine(config, rank) builds one in-process (tests, scripts, Ray replicas)
``proc``      the worker process loop (rank 0 reads the pipe; CFG-parallel ranks follow)
``client``    EngineClient: what the front end talks to; ProcessClient (a worker process),
              InprocClient (an engine in this process), ReplicaSet (several, with session affinity)
``shm``       camera arrays to the worker through shared memory
``recorder``  session recordings (server.record_dir), written between requests
"""
