"""``ardiff-serve --ray`` without a cluster: how the config becomes the Ray Serve deployment (replicas,
autoscaling bounds, GPUs per replica, each replica's devices), the proxy's frame limit, the stuck-step
health check, and the one-line answer when Ray is not installed. None of this needs Ray."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ardiff_server.config import ConfigError, load_config
from ardiff_server.extras import pip_command
from ardiff_server.ray.plan import plan_deployment, replica_config
from ardiff_server.ray.proxy import proxy_environment
from ardiff_server.ray.replica import EngineReplica
from tests.helpers.server_harness import REPO


def test_tiny_on_cpu_defaults_to_engine_replicas_without_gpus():
    plan = plan_deployment(load_config("tiny", ["engine.replicas=3"]))
    assert (plan.num_replicas, plan.num_gpus, plan.num_cpus, plan.world_size, plan.threads) == (3, 0.0, 1.0, 1, 1)
    assert plan.model_options() == {
        "max_ongoing_requests": 64,
        "num_replicas": 3,
        "ray_actor_options": {"num_gpus": 0.0, "num_cpus": 1.0},
    }
    assert plan.describe() == "3 replicas"


def test_ray_section_overrides_and_autoscaling_bounds_pass_through():
    plan = plan_deployment(load_config("tiny", ["ray.num_replicas=2", "ray.num_cpus=4", "ray.max_ongoing_requests=8"]))
    assert (plan.num_replicas, plan.threads, plan.max_ongoing_requests) == (2, 4, 8)
    plan = plan_deployment(load_config("tiny", ["ray.min_replicas=1", "ray.max_replicas=4"]))
    options = plan.model_options()
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 1}
    assert plan.describe() == "1-4 replicas, autoscaling"
    assert plan.most_replicas == 4  # per-key fair shares divide the most it may run
    assert plan_deployment(load_config("tiny", ["ray.num_replicas=2"])).most_replicas == 2
    assert plan_deployment(load_config("tiny", ["ray.min_replicas=0", "ray.max_replicas=2"])).initial_replicas == 1


def test_a_cuda_replica_gets_one_gpu_per_cfg_rank_and_sees_them_as_cuda_0_and_1():
    single = load_config("dreamzero_droid", ["engine.device=cuda:3"])
    plan = plan_deployment(single)
    assert plan.num_gpus == 1.0
    engine = replica_config(single, plan).engine
    assert (engine.device, engine.devices, engine.replicas) == ("cuda:0", None, 1)

    pair = load_config("dreamzero_droid_cfg2", ["engine.replicas=4"])
    plan = plan_deployment(pair)
    assert (plan.num_gpus, plan.world_size, plan.num_replicas) == (2.0, 2, 4)
    engine = replica_config(pair, plan).engine
    assert (engine.device, engine.devices, engine.replica_devices) == ("cuda:0", ["cuda:0", "cuda:1"], None)


@pytest.mark.parametrize(
    ("config", "overrides", "message"),
    [
        ("dreamzero_droid", ["ray.num_gpus=0"], "engine.device is CUDA but ray.num_gpus is 0"),
        ("tiny", ["ray.num_gpus=1"], "ray.num_gpus=1 but the engine runs on cpu"),
        ("dreamzero_droid_cfg2", ["ray.num_gpus=1"], "needs ray.num_gpus=2 per replica"),
    ],
)
def test_impossible_gpu_requests_are_refused_naming_the_key(config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        plan_deployment(load_config(config, overrides))


def test_the_proxy_takes_the_frame_limit_and_keepalive_from_the_config():
    env = proxy_environment(load_config("dreamzero_droid"))
    assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "ardiff_server.ray.proxy.configure_proxy"
    assert int(env["ARDIFF_WS_MAX_SIZE"]) > 64 * 2**20
    assert (env["ARDIFF_WS_PING_INTERVAL_S"], env["ARDIFF_WS_PING_TIMEOUT_S"]) == ("60.0", "600.0")


def test_configure_proxy_gives_uvicorn_the_frame_limit(monkeypatch):
    uvicorn = pytest.importorskip("uvicorn", reason="uvicorn comes with Ray Serve (pip install -e '.[ray]')")
    from ardiff_server.ray.proxy import configure_proxy

    monkeypatch.setattr(uvicorn.Config, "__init__", uvicorn.Config.__init__)  # restored afterwards
    for key, value in proxy_environment(load_config("tiny", ["server.ping_interval_s=null"])).items():
        monkeypatch.setenv(key, value)
    assert configure_proxy() == [] and configure_proxy() == []  # idempotent
    config = uvicorn.Config(lambda scope, receive, send: None)
    assert config.ws_max_size == 64 * 2**20 + 4096 and config.ws_ping_interval is None and config.ws_ping_timeout == 60.0
    assert config.ws_per_message_deflate is False


def test_a_step_past_the_request_timeout_fails_the_replicas_health_check():
    """The replica's InprocClient says ``stuck`` once a step runs past server.request_timeout_s;
    Serve then replaces the replica (an in-process step cannot be interrupted)."""
    import asyncio
    import threading

    from ardiff_server.engine.inproc_client import InprocClient

    class Engine:
        class policy:
            info = None

        def stats(self):
            return None

    replica = object.__new__(EngineReplica)  # no Ray: only what check_health reads
    replica.config = load_config("tiny", ["server.request_timeout_s=5"])
    client = InprocClient(Engine(), step_timeout_s=5)
    client._state, client._thread = "ready", threading.current_thread()  # as if started
    replica.client = client
    asyncio.run(replica.check_health())
    client.busy_since = time.monotonic() - 6
    with pytest.raises(RuntimeError, match=r"the engine is stuck \(server\.request_timeout_s=5\)"):
        asyncio.run(replica.check_health())


def test_without_ray_the_cli_says_how_to_install_it():
    code = "import sys; sys.modules['ray'] = None; from ardiff_server.cli import main; sys.exit(main(['--ray']))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]  # this environment's own pip (.venv/bin/pip from the repository), never a bare pip
    assert (
        last
        == f"ardiff-serve: --ray needs Ray Serve (ray is not installed): {pip_command()} install -e '.[ray]' (bash scripts/serve.sh --ray installs it too)"
    )


def test_the_proxy_gets_the_certificate_paths_the_start_up_check_read(monkeypatch, tmp_path):
    """uvicorn (Serve's proxy) opens the paths as given: a ``~`` in a config file must be expanded for it."""
    from ardiff_server.ray.run import http_options

    monkeypatch.setenv("HOME", str(tmp_path))
    options = http_options(load_config("tiny", ["server.tls_cert=~/certs/fullchain.pem", "server.tls_key=~/certs/key.pem"]), 8443)
    assert options["ssl_certfile"] == str(tmp_path / "certs" / "fullchain.pem") and options["ssl_keyfile"] == str(tmp_path / "certs" / "key.pem")
    options = http_options(load_config("tiny", ["server.tls_cert=~/both.pem"]), 8443)
    assert options["ssl_keyfile"] == options["ssl_certfile"] == str(tmp_path / "both.pem")


def test_sighup_under_ray_is_logged_not_fatal():
    """A certbot deploy hook sends SIGHUP; under --ray (no reload there) it is logged and ignored."""
    code = (
        "import logging, os, signal, time\n"
        "from ardiff_server.ray.run import ignore_sighup\n"
        "logging.basicConfig(format='%(message)s')\n"
        "ignore_sighup(logging.getLogger('ardiff_server'))\n"
        "os.kill(os.getpid(), signal.SIGHUP)\n"
        "time.sleep(0.2)\n"
        "print('still here')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "still here" in result.stdout, result.stderr
    assert "SIGHUP ignored under --ray" in result.stderr and "redeploy" in result.stderr


def test_a_tls_handshake_timeout_the_proxy_cannot_apply_is_refused():
    with pytest.raises(ConfigError, match=r"server\.tls_handshake_timeout_s=3 cannot be applied under --ray"):
        plan_deployment(load_config("tiny", ["server.tls_handshake_timeout_s=3"]))


def test_model_replicas_get_the_drivers_hugging_face_environment(tmp_path, monkeypatch):
    """Replicas resolve Hub ids on their own nodes: HF_TOKEN, HF_HUB_OFFLINE, HF_HOME (absolute) reach their runtime_env."""
    from ardiff_server.ray.plan import hub_environment

    monkeypatch.chdir(tmp_path)
    env = {"HF_TOKEN": "hf_secret", "HF_HUB_OFFLINE": "1", "HF_HOME": "hf-home", "PATH": "/bin", "HF_UNRELATED": "x"}
    hub = hub_environment(env)
    assert hub == {"HF_TOKEN": "hf_secret", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    options = plan_deployment(load_config("tiny")).model_options(hub)
    assert options["ray_actor_options"]["runtime_env"] == {"env_vars": hub}
    assert "runtime_env" not in plan_deployment(load_config("tiny")).model_options({})["ray_actor_options"]
