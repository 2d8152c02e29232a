"""Client-side tools: ``replay`` (``ardiff-client``: replay a camera folder or synthetic frames
against a server) and ``media`` (reading videos, resizing frames, plotting action chunks; also
used by the engine's session recorder). Torch-free."""
