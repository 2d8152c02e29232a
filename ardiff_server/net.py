"""Network helpers shared by the start-up paths (worker process groups, the Ray HTTP proxy, TLS)."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (a wildcard host is probed on loopback)."""
    with socket.socket() as s:
        s.bind((host if host not in ("", "0.0.0.0") else "127.0.0.1", 0))
        return s.getsockname()[1]


class TlsError(ValueError):
    """A certificate or key that cannot be served; the message is one line naming the file and the fix."""


def server_tls_context(cert: str, key: str | None = None) -> ssl.SSLContext:
    """The server side of ``wss://`` and ``https://``: TLS 1.2 or newer, ``cert`` (a PEM chain, leaf
    first: Let's Encrypt's ``fullchain.pem``) and ``key`` (PEM, unencrypted; None: it is in ``cert``).
    Raises :class:`TlsError` for a missing, unreadable, malformed, encrypted or mismatched pair."""
    cert = str(Path(cert).expanduser())
    key = str(Path(key).expanduser()) if key is not None else None
    cert_text = _read(cert, "server.tls_cert")
    if "-----BEGIN CERTIFICATE-----" not in cert_text:
        raise TlsError(f"server.tls_cert: {cert} holds no PEM certificate (-----BEGIN CERTIFICATE-----); give the certificate chain, e.g. fullchain.pem")
    key_text, key_option = (_read(key, "server.tls_key"), "server.tls_key") if key is not None else (cert_text, "server.tls_cert")
    key_file = key if key is not None else cert
    if "PRIVATE KEY-----" not in key_text:
        hint = "" if key is not None else " (no server.tls_key was given, so the key must be in the certificate file)"
        raise TlsError(f"{key_option}: {key_file} holds no PEM private key{hint}; give the key, e.g. privkey.pem, with --tls-key")
    if "ENCRYPTED" in key_text:
        raise TlsError(f"{key_option}: {key_file} is encrypted with a passphrase; the server cannot prompt for it: {_DECRYPT}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key, password=_no_passphrase(key_option, key_file))
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TlsError(f"{key_option}: {key_file} is not the private key of the certificate in {cert}; give the key it was issued with") from None
        raise TlsError(f"server.tls_cert/tls_key: OpenSSL cannot load {cert} with {key_file} ({exc.reason or exc}); check both are PEM") from None
    except OSError as exc:  # replaced or removed since it was read (after SSLError: a subclass)
        raise TlsError(f"server.tls_cert/tls_key: cannot load {cert} with {key_file} ({exc.strerror or exc})") from None
    return context


_DECRYPT = "write a decrypted copy readable only by the server's user (openssl pkey -in KEY -out KEY.plain; chmod 600 KEY.plain)"


def _read(path: str, option: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        raise TlsError(f"{option}: {path} does not exist; give the path of a PEM file") from None
    except OSError as exc:
        raise TlsError(f"{option}: cannot read {path} ({exc.strerror}); make it a file the server's user can read") from None


def _no_passphrase(option: str, path: str):
    def refuse() -> bytes:  # OpenSSL's default would prompt on the terminal and hang a service
        raise TlsError(f"{option}: {path} is encrypted with a passphrase; the server cannot prompt for it: {_DECRYPT}")

    return refuse
