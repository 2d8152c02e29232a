"""ardiff_client: the robot side of an ardiff-server (or any OpenPI / RoboArena / DreamZero websocket server), torch-free.

openpi-client's shape: ``websocket_client`` (one connection: the metadata frame, then one request -> one reply;
``WebsocketPolicy``), ``async_runner`` (``AsyncChunkRunner``: a control loop that asks for its next chunk while it
executes this one), ``chunk_reply`` (a reply checked before the robot executes it), and the ``ardiff-client``
command (``replay``: the command line; ``infer_request``, ``episode``, ``cameras``, ``video``, ``records``,
``report``, ``async_report``). It imports the server's torch-free wire codec (``ardiff_server.wire.protocol``) and
frame helpers (``ardiff_server.media``); the server never imports it (tests/test_layout.py).
"""
