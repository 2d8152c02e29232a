"""Start the real server process (``python -m ardiff_server``) for end-to-end tests."""

from __future__ import annotations

import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[2]


def fake_config(**engine_and_policy) -> dict:
    """A config serving tests/helpers/fake_policy.py (fast, deterministic)."""
    policy = {"name": "fake", **engine_and_policy.pop("policy", {})}
    server = {"session_ttl_s": 30, **engine_and_policy.pop("server", {})}
    return {"plugins": ["tests.helpers.fake_policy"], "server": server, "engine": {"kv_budget_gib": 0.01, **engine_and_policy}, "policy": policy}


class ServerProcess:
    def __init__(self, config: dict | str, tmp_path: Path, args: list[str] = (), env: dict | None = None) -> None:
        if isinstance(config, dict):
            path = tmp_path / f"config-{time.monotonic_ns()}.yaml"
            path.write_text(yaml.safe_dump(config))
            config = str(path)
        self.lines: list[str] = []
        self.port: int | None = None
        self.scheme = "ws"  # wss when the banner says so (--tls-cert)
        self.client_ssl: ssl.SSLContext | None = None  # what http() trusts over https
        environ = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ardiff_server", "--config", config, "--port", "0", *args],
            cwd=REPO,
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            match = re.search(r"listening on (wss?)://[^:]+:(\d+)", line)
            if match:
                self.scheme, self.port = match.group(1), int(match.group(2))
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout: float = 180) -> ServerProcess:
        if not self._ready.wait(timeout) or self.port is None:
            self.kill()
            raise RuntimeError("server did not start:\n" + self.log())
        return self

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def http(self, path: str, headers: dict | None = None, timeout: float = 5.0) -> tuple[int, str]:
        scheme = "https" if self.scheme == "wss" else "http"
        request = urllib.request.Request(f"{scheme}://127.0.0.1:{self.port}{path}", headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self.client_ssl) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def metric(self, name: str) -> float:
        """A metric's value: ``name`` may carry a subset of its labels (``x{rank="0"}``); the values
        of every series that has them are summed (e.g. over replicas). KeyError if none."""
        return metric_value(self.http("/metrics")[1], name)

    def worker_pids(self) -> list[int]:
        for line in reversed(self.lines):
            match = re.search(r"worker ready in .* \(pids \[([\d, ]+)\]", line)
            if match:
                return [int(p) for p in match.group(1).split(",")]
        raise RuntimeError("no worker pid in the log")

    def log(self) -> str:
        return "\n".join(self.lines[-200:])

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> ServerProcess:
        return self.wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()


def metric_value(text: str, name: str) -> float:
    base, _, labels = name.partition("{")
    wanted = set(re.findall(r'(\w+)="([^"]*)"', labels))
    values = []
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        series_name, _, series_labels = series.partition("{")
        if series_name == base and wanted <= set(re.findall(r'(\w+)="([^"]*)"', series_labels)):
            values.append(float(value))
    if not values:
        raise KeyError(name)
    return sum(values)


def droid_observation(
    frames: int = 1,
    *,
    session_id: str | None = None,
    prompt: str = "pick up the cup",
    joint0: float = 0.0,
    one_indexed: bool = False,
    size: tuple[int, int] = (180, 320),
    seed: int = 0,
    endpoint: str | None = None,
) -> dict:
    """A RoboArena/DROID request dict as clients send it."""
    rng = np.random.default_rng(seed)
    shape = (size[0], size[1], 3) if frames == 1 else (frames, size[0], size[1], 3)
    first, second = ("1", "2") if one_indexed else ("0", "1")
    obs = {
        f"observation/exterior_image_{first}_left": rng.integers(0, 256, shape, dtype=np.uint8),
        f"observation/exterior_image_{second}_left": rng.integers(0, 256, shape, dtype=np.uint8),
        "observation/wrist_image_left": rng.integers(0, 256, shape, dtype=np.uint8),
        "observation/joint_position": np.array([joint0, 0.1, -0.2, -2.0, 0.0, 2.0, 0.5], dtype=np.float64),
        "observation/gripper_position": np.array([0.2], dtype=np.float64),
        "observation/cartesian_position": np.zeros(6, dtype=np.float64),
        "prompt": prompt,
    }
    if session_id is not None:
        obs["session_id"] = session_id
    if endpoint is not None:
        obs["endpoint"] = endpoint
    return obs
