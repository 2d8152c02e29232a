"""Network helpers shared by the start-up paths (worker process groups, the Ray HTTP proxy, TLS, the listening port)."""

from __future__ import annotations

import errno
import socket
import ssl
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (a wildcard host is probed on loopback)."""
    with socket.socket() as s:
        s.bind((host if host not in ("", "0.0.0.0") else "127.0.0.1", 0))
        return s.getsockname()[1]


class ListenError(RuntimeError):
    """The server cannot listen on its address; the message is one line naming it and the fix."""


def bind_listeners(host: str, port: int) -> list[socket.socket]:
    """Bind (not yet listen on) every address ``host`` resolves to, as asyncio's ``create_server``
    would: before the model loads, so a port in use fails in a second, not after the load.
    Not listening yet: connections during the load are refused, as before, rather than queued.
    Raises :class:`ListenError`."""
    try:
        # "" is every interface to asyncio (and to getaddrinfo, None)
        addresses = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(
            f"cannot listen on {_address(host, port)}: cannot resolve {host} ({exc.strerror}); pick --host 127.0.0.1 or 0.0.0.0"
        ) from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart reuses a port in TIME_WAIT
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # :: next to 0.0.0.0, as asyncio does
            sock.bind(address)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise listen_error(host, port, exc) from None
    return sockets


def listen_error(host: str, port: int, exc: OSError) -> ListenError:
    """A bind or listen failure on ``host:port`` as one line with what to do."""
    reasons = {
        errno.EADDRINUSE: "address already in use; stop the other server or pick another --port (0 picks a free one)",
        errno.EACCES: "permission denied (ports below 1024 need privileges); pick --port 1024 or above",
        errno.EADDRNOTAVAIL: "no such address on this machine; pick --host 127.0.0.1 or 0.0.0.0 (every interface)",
    }
    reason = reasons.get(exc.errno, exc.strerror or str(exc))
    return ListenError(f"cannot listen on {_address(host, port)}: {reason}")


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
        raise TlsError(
            f"server.tls_cert: {cert} holds no PEM certificate (-----BEGIN CERTIFICATE-----); give the certificate chain, e.g. fullchain.pem"
        )
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
