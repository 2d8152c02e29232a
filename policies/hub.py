"""Model files by local path or Hugging Face id (torch-free: the front end resolves them).

A setting such as ``policy.checkpoint`` names its files in one of two ways, decided in this order:

1. an existing local path (``~`` expanded) is used as it is, even if it also looks like an id;
2. ``org/name`` or ``org/name@revision`` (a branch, tag or commit) is a Hugging Face id, fetched
   with ``huggingface_hub.snapshot_download``: the ``HF_HOME`` / ``HF_HUB_CACHE`` cache, ``HF_TOKEN``,
   ``HF_HUB_OFFLINE=1`` and its progress bars all apply, and only the files a policy reads are
   fetched (``allow_patterns``);
3. anything else is an error: a path-like string (``/...``, ``./...``, ``~/...``, more than one
   ``/``) that does not exist, or a string that is neither.

The front end resolves ids once, before any worker is spawned, and hands the workers the local
snapshot directory: CFG-parallel ranks and replicas share one download and never touch the network.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

# Hugging Face repo names: letters, digits, '-', '_', '.'; no '--' or '..'; at most 96 characters.
_PART = r"[A-Za-z0-9](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?:@(?P<revision>[\w.+/-]+))?$")
# The hub cache's folder of one snapshot: <cache>/models--<org>--<name>/snapshots/<commit>
_SNAPSHOT = re.compile(r"models--(?P<org>.+?)--(?P<name>.+)/snapshots/(?P<commit>[0-9a-f]{40})/?$")


class HubError(ValueError):
    """A local-or-hub reference that cannot be resolved; the message is one line with the fix."""


@dataclass(frozen=True)
class HubId:
    repo_id: str  # org/name
    revision: str | None = None  # branch, tag or commit; None: the default branch

    @classmethod
    def parse(cls, text: str) -> HubId | None:
        match = _HUB_ID.match(text)
        if match is None or "--" in match["repo"] or ".." in match["repo"]:
            return None
        revision = match["revision"]
        if revision is not None and (".." in revision or revision.startswith("/") or revision.endswith("/")):
            return None
        return cls(match["repo"], revision)

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def looks_like_path(text: str) -> bool:
    """A string a user meant as a path (checked before the id shape: ``./org/name`` is a path)."""
    return text.startswith(("/", "~", ".")) or text.partition("@")[0].count("/") > 1 or "\\" in text


def classify(text: str, *, key: str, example: str) -> Path | HubId:
    """An existing local path, else a Hugging Face id; raises HubError (one line) for anything else.
    ``example`` is a placeholder local path for the fix (e.g. ``/path/to/umt5-xxl``)."""
    path = Path(text).expanduser()
    if text and path.exists():
        return path
    if looks_like_path(text):
        raise HubError(f"{key}: {path} does not exist; give a local directory (--set {key}={example}) or a Hugging Face id (org/name[@revision])")
    hub_id = HubId.parse(text)
    if hub_id is None:
        raise HubError(
            f"{key}: {text!r} is neither an existing local directory nor a Hugging Face id (org/name or org/name@revision); "
            f"e.g. --set {key}={example}"
        )
    return hub_id


def snapshot_label(path: str | Path) -> str | None:
    """``org/name@<commit>`` for a directory inside a hub cache, else None (for /info and logs)."""
    match = _SNAPSHOT.search(Path(path).as_posix())
    return f"{match['org']}/{match['name']}@{match['commit']}" if match else None


def download(hub_id: HubId, *, key: str, example: str, allow_patterns: Sequence[str]) -> Path:
    """The local snapshot directory of ``hub_id`` with the files matching ``allow_patterns``
    (downloaded into the hub cache if missing). Raises HubError with one line naming the id and the fix."""
    # Imported here: the front end pays for it only when an id is given, and the environment
    # (HF_HUB_OFFLINE, HF_HOME) is read by huggingface_hub when it is first imported.
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    fetch = download_command(hub_id, allow_patterns)
    local = f"give a local directory (--set {key}={example})"
    try:
        folder = snapshot_download(hub_id.repo_id, revision=hub_id.revision, allow_patterns=list(allow_patterns))
    except RevisionNotFoundError:
        raise HubError(f"{key}: {hub_id.repo_id} has no revision {hub_id.revision!r} on the Hugging Face Hub") from None
    except GatedRepoError:
        raise HubError(
            f"{key}: {hub_id.repo_id} is gated: accept its terms on https://huggingface.co/{hub_id.repo_id} and set HF_TOKEN "
            f"(or hf auth login), or {local}"
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"{key}: {hub_id.repo_id} is not on the Hugging Face Hub (or it is private: set HF_TOKEN); no local directory "
            f"of that name exists either; {local}"
        ) from None
    except LocalEntryNotFoundError as exc:
        offline = getattr(constants, "is_offline_mode", None)
        if offline() if offline is not None else constants.HF_HUB_OFFLINE:
            why = "HF_HUB_OFFLINE=1 forbids downloading it"
        else:
            cause = exc.__cause__ or exc
            why = f"the Hub cannot be reached ({type(cause).__name__}: {_first_line(cause)})"
        raise HubError(
            f"{key}: {hub_id} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}; {local}, "
            f"or fetch it where the Hub is reachable ({fetch}) and serve from that cache with HF_HUB_OFFLINE=1"
        ) from None
    except HfHubHTTPError as exc:
        raise HubError(f"{key}: fetching {hub_id} from the Hugging Face Hub failed: {_first_line(exc)}; {local}") from None
    except _transport_errors() as exc:  # a proxy that refuses (403 to CONNECT) or hangs up, a timeout, a TLS failure
        raise HubError(
            f"{key}: {hub_id} cannot be fetched: {_no_route()} ({type(exc).__name__}: {_first_line(exc)}); "
            f"{local}, or fetch it where the Hub is reachable ({fetch}) and serve from that cache with HF_HUB_OFFLINE=1"
        ) from None
    except (OSError, ValueError) as exc:  # disk full, an incomplete cached snapshot, a malformed cache
        raise HubError(f"{key}: cannot use {hub_id} from the Hugging Face cache: {_first_line(exc)}; {local} or re-run {fetch}") from None
    path = Path(folder)
    logger.info("%s: %s -> %s", key, hub_id, path)
    return path


def download_command(hub_id: HubId, allow_patterns: Sequence[str]) -> str:
    """``hf download <id> [--revision R] --include ...``: only the files the server reads (``google/umt5-xxl``'s
    tokenizer, not its tens of GB of weights). ``hf`` takes one ``--include`` per pattern from huggingface_hub 1.0
    (its Typer CLI); before, one ``--include`` followed by every pattern."""
    import shlex

    from huggingface_hub import __version__ as hub_version

    command = f"hf download {hub_id.repo_id}" + (f" --revision {hub_id.revision}" if hub_id.revision else "")
    if not allow_patterns:
        return command
    quoted = [shlex.quote(p) for p in allow_patterns]
    if int(hub_version.split(".")[0]) >= 1:
        return command + "".join(f" --include {q}" for q in quoted)
    return command + " --include " + " ".join(quoted)


def resolve(text: str, *, key: str, example: str, allow_patterns: Sequence[str]) -> Path:
    """A local directory for ``text`` (a path, or a Hugging Face id fetched into the hub cache)."""
    where = classify(text, key=key, example=example)
    if isinstance(where, Path):
        return where
    return download(where, key=key, example=example, allow_patterns=allow_patterns)


# The HTTP clients huggingface_hub has used (requests up to 0.x, httpx since 1.0, or a vendored
# httpx2): their error families, whichever of them is loaded. Exceptions huggingface_hub does not
# translate into its own (a proxy's refusal, a dropped connection) arrive as these.
_CLIENT_ERRORS = {
    "requests": ("RequestException",),
    "httpx": ("HTTPError", "StreamError", "InvalidURL"),
    "httpx2": ("HTTPError", "StreamError", "InvalidURL"),
    "httpcore": ("ProxyError", "NetworkError", "TimeoutException", "ProtocolError"),
    "httpcore2": ("ProxyError", "NetworkError", "TimeoutException", "ProtocolError"),
    "urllib3": ("HTTPError",),
}


def _transport_errors() -> tuple[type[BaseException], ...]:
    """The loaded HTTP clients' error base classes (nothing is imported for this)."""
    found = []
    for module_name, names in _CLIENT_ERRORS.items():
        module = sys.modules.get(module_name)
        for name in names if module is not None else ():
            error = getattr(module, name, None)
            if isinstance(error, type) and issubclass(error, BaseException):
                found.append(error)
    return tuple(found)


def _no_route() -> str:
    """Who could not reach the Hub: the proxy the environment names (credentials left out), or this machine."""
    for variable in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        if os.environ.get(variable):
            return f"the proxy {_without_credentials(os.environ[variable])} ({variable}) refused or dropped the connection to the Hub"
    return "the Hub cannot be reached"


def _without_credentials(url: str) -> str:
    scheme, sep, rest = url.rpartition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
