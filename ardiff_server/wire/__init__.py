"""The wire, torch-free: the msgpack-numpy codec (``protocol``), the one way a request comes in (``decode``:
which protocol a message speaks, then ``openpi`` or ``lingbot_va`` decodes it), the fields both read (``fields``),
camera images (``images``, ``jpeg``) and the per-request pixel budget (``budget``). Spec: ``docs/spec.md`` §3-§4."""
