"""TLS on the server's one port: ``wss://`` and ``https://`` (``--tls-cert``/``--tls-key``), reloaded on SIGHUP.

The listener keeps one :class:`ssl.SSLContext` for its whole life. Each handshake is moved to the
newest loaded context in the SNI callback (OpenSSL calls it for every ClientHello, with a server
name or without), so a reload changes the certificate of new connections only; connected robots
keep theirs. A reload that cannot load the files (renewal half-written, key mismatch) keeps the
current certificate and says why.

A ``ws://`` or ``http://`` request to the port fails OpenSSL's handshake on its first bytes
(``HTTP_REQUEST``) and asyncio closes the connection at once: clients that try ``ws://`` first
reach their ``wss://`` fallback in milliseconds. A client that sends nothing is dropped after
``server.tls_handshake_timeout_s``. Failed handshakes are counted in ``/metrics`` by kind.
"""

from __future__ import annotations

import logging
import ssl
import time
from collections.abc import Callable

from ardiff_server.net import TlsError, server_tls_context

logger = logging.getLogger(__name__)

_PLAINTEXT = {"HTTP_REQUEST", "HTTPS_PROXY_REQUEST", "WRONG_VERSION_NUMBER"}
_OLD_VERSION = {"UNSUPPORTED_PROTOCOL", "TLSV1_ALERT_PROTOCOL_VERSION", "VERSION_TOO_LOW"}


def failure_kind(exc: ssl.SSLError) -> str:
    """The ``ardiff_tls_handshake_failures`` kind of a failed handshake."""
    reason = exc.reason or ""
    if reason in _PLAINTEXT:
        return "plaintext"
    if reason in _OLD_VERSION:
        return "protocol_version"
    if "CERTIFICATE" in reason or "UNKNOWN_CA" in reason:  # the client's alert: it does not trust ours
        return "certificate"
    return "other"


class ServerTls:
    """The listener's context and the certificate it currently serves."""

    def __init__(
        self,
        cert: str,
        key: str | None,
        *,
        on_failure: Callable[[str], None] = lambda kind: None,
        on_reload: Callable[[bool], None] = lambda ok: None,
    ) -> None:
        self.cert, self.key = cert, key
        self.on_reload = on_reload
        self.current = server_tls_context(cert, key)  # raises TlsError (preflight has said it in one line)
        self.context = self.current  # the listener's, for good; later certificates are switched to per handshake
        self.context.sni_callback = self._select
        self.context.sslobject_class = type("CountedSSLObject", (_CountedSSLObject,), {"on_failure": staticmethod(on_failure)})
        self.loaded_at = time.time()

    def _select(self, ssl_object: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        if self.current is not context:
            ssl_object.context = self.current

    def reload(self) -> bool:
        """Load the files again (SIGHUP). New handshakes get the new certificate; open connections
        keep theirs. On failure the current certificate stays."""
        try:
            self.current = server_tls_context(self.cert, self.key)
        except TlsError as exc:
            logger.error("TLS certificate not reloaded, still serving the one loaded at %s: %s", time.ctime(self.loaded_at), exc)
            self.on_reload(False)
            return False
        self.loaded_at = time.time()
        logger.info("TLS certificate reloaded from %s; new connections use it, open ones keep theirs", self.cert)
        self.on_reload(True)
        return True


class _CountedSSLObject(ssl.SSLObject):
    """Counts failed handshakes (the context's ``sslobject_class``; asyncio drives the handshake)."""

    on_failure: Callable[[str], None] = staticmethod(lambda kind: None)
    _warned_at = 0.0

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise
        except ssl.SSLError as exc:
            kind = failure_kind(exc)
            self.on_failure(kind)
            if kind == "certificate" and time.monotonic() - _CountedSSLObject._warned_at > 60:  # at most one line a minute
                _CountedSSLObject._warned_at = time.monotonic()
                logger.warning("a client refused this server's certificate (%s): expired, or not for the name it connected to?", exc.reason)
            else:
                logger.debug("TLS handshake failed (%s): %s", kind, exc)
            raise
