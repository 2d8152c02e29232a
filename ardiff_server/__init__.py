"""ardiff-server: an OpenPI-compatible websocket server for autoregressive video-diffusion policies."""

__version__ = "0.2.0"
