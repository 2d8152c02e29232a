"""Client-side tools, torch-free: ``replay`` (``ardiff-client``: one episode against a server; the
command line, the protocol and the episode loop), with ``cameras`` (where its frames come from),
``records`` (what a run produced) and ``report`` (tables, JSON, recordings, plots); and ``media``
(reading videos, resizing frames, plotting action chunks; also used by the engine's session
recorder)."""
