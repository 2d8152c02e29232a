"""Optional API keys: where they come from, and how a handshake's credentials are checked.

Clients send ``Authorization: Api-Key <key>`` (openpi-client) or ``Authorization: Bearer <key>``
(vLLM-Omni, OpenAI-style clients); the scheme is case-insensitive. Anything malformed (no header,
two headers, an unknown scheme, an empty or non-ASCII token) is refused with HTTP 401 and one log
line, never an exception. Keys come from ``--api-key`` (visible in the process list),
``--api-key-file`` (one per line) or ``ARDIFF_API_KEYS`` (comma-separated).
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Sequence
from pathlib import Path

ENV_VAR = "ARDIFF_API_KEYS"
SCHEMES = ("api-key", "bearer")
# Schemes that may be named in a refusal: IANA's HTTP authentication scheme registry and a few common
# others. Anything else may be a key sent without a scheme (a short alphabetic key looks like a
# scheme), so only its length is logged.
KNOWN_SCHEMES = frozenset(
    (
        "basic",
        "digest",
        "negotiate",
        "ntlm",
        "hoba",
        "mutual",
        "oauth",
        "scram-sha-1",
        "scram-sha-256",
        "vapid",
        "privatetoken",
        "concealed",
        "dpop",
        "gnap",
        "token",
        "aws4-hmac-sha256",
    )
)


class Unauthorized(Exception):
    """The handshake's credentials are missing or wrong; the message is safe to log."""


class ApiKeys:
    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = [key.encode() for key in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: Sequence[str]) -> str | None:
        """The id of the key these ``Authorization`` header values carry (``key0``, ...), None when
        no keys are configured. Raises :class:`Unauthorized`."""
        if not self._keys:
            return None
        if not authorization:
            raise Unauthorized("no Authorization header")
        if len(authorization) > 1:
            raise Unauthorized(f"{len(authorization)} Authorization headers")
        scheme, _, token = authorization[0].strip().partition(" ")
        if scheme.lower() not in SCHEMES:
            # A key sent without a scheme arrives here as the "scheme": never log it.
            shown = repr(scheme) if scheme.lower() in KNOWN_SCHEMES else f"of {len(scheme)} characters (not shown)"
            raise Unauthorized(f"unsupported scheme {shown} (expected Api-Key or Bearer)")
        token = token.strip()
        if not token:
            raise Unauthorized("empty token")
        # Bytes, not str: hmac.compare_digest raises on non-ASCII str. Header text may carry
        # undecodable bytes as surrogates; surrogateescape gives those bytes back.
        given = token.encode("utf-8", "surrogateescape")
        matches = [hmac.compare_digest(given, key) for key in self._keys]  # every key: no early exit
        if not any(matches):
            raise Unauthorized("wrong key")
        return f"key{matches.index(True)}"


def gather_api_keys(cli_keys: Sequence[str], key_file: str | None, environ: dict[str, str] | None = None) -> list[str]:
    """Keys from the command line, a file (one per line, ``#`` comments) and ``ARDIFF_API_KEYS``.
    Empty entries are kept so that config validation refuses them by position."""
    environ = os.environ if environ is None else environ
    keys = list(cli_keys)
    if key_file is not None:
        from_file = [line.strip() for line in Path(key_file).expanduser().read_text().splitlines()]
        from_file = [line for line in from_file if line and not line.startswith("#")]
        if not from_file:  # an empty file must not mean "no authentication"
            raise ValueError(f"--api-key-file {key_file}: no keys in it (one key per line)")
        keys += from_file
    if ENV_VAR in environ:
        keys += [part.strip() for part in environ[ENV_VAR].split(",")]
    return keys
