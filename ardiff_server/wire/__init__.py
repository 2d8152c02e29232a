"""The OpenPI wire, torch-free: the msgpack-numpy codec (``protocol``) and request decoding
(``decode``: where an observation is decoded). Spec: ``docs/spec.md`` §3-§4."""
