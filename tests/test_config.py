"""Configs (ardiff_server/config.py): files, --set overrides, named errors, and preflight before any worker."""

from __future__ import annotations

import pytest

from ardiff_server.config import CONFIG_DIR, ConfigError, apply_override, load_config, preflight, resolve_config_path, validate_config


def test_every_shipped_config_loads():
    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
    assert "tiny" in names
    for name in names:
        assert load_config(name).source.endswith(f"{name}.yaml")


def test_overrides_are_parsed_as_yaml_into_dotted_keys():
    raw: dict = {"engine": {"device": "cpu"}}
    apply_override(raw, "engine.cfg_parallel_size=2")
    apply_override(raw, "server.api_keys=[a, b]")
    apply_override(raw, "server.record_dir=")
    apply_override(raw, "server.idle_timeout_s=null")
    assert raw == {"engine": {"device": "cpu", "cfg_parallel_size": 2}, "server": {"api_keys": ["a", "b"], "record_dir": "", "idle_timeout_s": None}}
    with pytest.raises(ConfigError, match=r"expected dotted\.key=value"):
        apply_override(raw, "engine.device")
    with pytest.raises(ConfigError, match="device is not a section"):
        apply_override(raw, "engine.device.index=1")


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["server.prot=8000"], r"server\.prot: unknown key"),
        (["server.port=eighty"], r"server\.port: .*\(got 'eighty'\)"),
        (["engine.cfg_parallel_size=3"], r"engine\.cfg_parallel_size"),
        (["policy.num_inference_steps=0"], r"policy\.num_inference_steps"),
        (["policy.name=nope"], r"policy\.name: unknown policy 'nope'"),
        (["server.api_keys=['']"], r"api_keys\[0\] is empty"),
        (["engine.devices=[cpu, cpu]"], r"devices lists 2 devices for cfg_parallel_size=1"),
        (["engine.cuda_graphs=true"], r"cuda_graphs needs a CUDA device"),
        # Each of these reached a worker and printed its traceback (the attack run's config sweep).
        (["policy.view_size=[0, 320]"], r"policy\.view_size\.0: Input should be greater than 0 \(got 0\)"),
        (["policy.image_resolution=[180, -1]"], r"policy\.image_resolution\.1: Input should be greater than 0"),  # was served as is
        (["engine.device=gpu"], r"engine\.device: Value error, expected cpu, cuda or cuda:<index> \(got 'gpu'\)"),
        (["engine.cfg_parallel_size=2", "engine.devices=[cuda:0, gpu1]"], r"engine\.devices: .*got 'gpu1'"),
        (["engine.replicas=2", "engine.replica_devices=[[cuda:0], [tpu]]"], r"engine\.replica_devices: .*got 'tpu'"),
        (["plugins=my_lab"], r"plugins: expected a list of module names .*got 'my_lab'"),  # was imported letter by letter
        (["engine.attention_backend=flash"], r"attention_backend flash .* needs CUDA devices, got cpu; use auto or sdpa"),
        (["engine.dist_backend=nccl", "engine.cfg_parallel_size=2", "engine.devices=[cpu, cpu]"], r"dist_backend nccl needs CUDA devices"),
    ],
)
def test_a_bad_value_names_the_file_and_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        load_config("tiny", overrides)
    assert "tiny.yaml" in str(info.value)


def test_unknown_config_names_list_the_shipped_ones(tmp_path):
    with pytest.raises(ConfigError, match=r"config 'tinny' not found .*'tiny'"):
        resolve_config_path("tinny")
    custom = tmp_path / "mine.yaml"
    custom.write_text("policy: {name: dreamzero}\n")
    assert resolve_config_path(custom) == custom
    custom.write_text("- not a mapping\n")
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        load_config(custom)


def test_plugins_that_do_not_import_are_named():
    with pytest.raises(ConfigError, match="plugins: cannot import 'no_such_plugin_module'"):
        validate_config({"plugins": ["no_such_plugin_module"], "policy": {"name": "noop"}})


def test_public_config_hides_the_keys():
    config = load_config("tiny", ["server.api_keys=[secret-1, secret-2]"])
    assert config.public()["server"]["api_keys"] == "<2 key(s)>"
    assert "secret-1" not in str(config.public())


def test_preflight_refuses_devices_this_machine_does_not_have(monkeypatch):
    monkeypatch.setattr("ardiff_server.config.installed_torch_is_cpu_build", lambda: False)  # as in .venv-gpu
    monkeypatch.setattr("ardiff_server.config.cuda_device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"engine device cuda:1: this machine has 1 CUDA device\(s\)"):
        preflight(load_config("tiny", ["engine.device=cuda:1"]))
    preflight(load_config("tiny", ["engine.device=cuda:1"]), local=False)  # Ray: the engines run elsewhere
    monkeypatch.setattr("ardiff_server.config.cuda_device_count", lambda: 0)
    with pytest.raises(ConfigError, match=r"no CUDA device; serve its tiny CPU twin \(--config tiny\)"):
        preflight(load_config("tiny", ["engine.device=cuda"]))
    with pytest.raises(ConfigError, match=r"no CUDA device; serve its tiny CPU twin \(--config tiny_lingbot_va\)"):
        preflight(load_config("tiny_lingbot_va", ["engine.device=cuda"]))
    with pytest.raises(ConfigError, match=r"no CUDA device; serve its tiny CPU twin \(--config tiny_lingbot_va_libero\)"):
        preflight(load_config("lingbot_va_libero"))  # refused before its checkpoint is looked up
    with pytest.raises(ConfigError, match=r"no CUDA device; serve its tiny CPU twin \(--config tiny_zero_wam\)"):
        preflight(load_config("zero_wam_robotwin"))


def test_a_cpu_torch_on_a_gpu_machine_is_named_with_gpu_as_the_fix(monkeypatch, caplog):
    """The CPU .venv on a GPU box: a CUDA config is refused before any download, naming the build and --gpu;
    a CPU config serves and says once that --gpu would use the GPU."""
    import torch

    from ardiff_server.config import installed_torch_is_cpu_build

    assert installed_torch_is_cpu_build() == (torch.version.cuda is None)  # found on disk, without importing torch
    monkeypatch.setattr("ardiff_server.config.installed_torch_is_cpu_build", lambda: True)
    monkeypatch.setattr("ardiff_server.config.cuda_device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"engine device cuda:0: this machine has 2 CUDA device\(s\) but torch .* is a CPU build; .*serve.sh --gpu"):
        preflight(load_config("tiny", ["engine.device=cuda:0"]))
    with caplog.at_level("INFO", logger="ardiff_server"):
        preflight(load_config("tiny"))
    assert "this machine has 2 CUDA device(s) and torch" in caplog.text and "--gpu" in caplog.text


def test_replica_devices_spread_over_gpus_or_must_be_given():
    config = load_config("tiny", ["engine.device=cuda", "engine.replicas=2", "engine.cfg_parallel_size=2", "policy.cfg_scale=5"])
    assert config.engine.replica_device_lists() == [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    config = load_config("tiny", ["engine.device=cuda:0", "engine.replicas=2"])
    with pytest.raises(ValueError, match=r"engine.device cuda:0 is one GPU: --set engine.device=cuda .* or give each replica its own"):
        config.engine.replica_device_lists()
    assert load_config("tiny", ["engine.replicas=3"]).engine.replica_device_lists() == [["cpu"]] * 3


def test_a_config_error_never_echoes_api_keys():
    with pytest.raises(ConfigError) as caught:  # a section-level error: the section is not printed
        load_config("tiny", ["server.tls_key=/tmp/k.pem", "server.api_keys=[secret-abc-123]"])
    assert "tls_key is set without tls_cert" in str(caught.value) and "secret-abc" not in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        load_config("tiny", ["server.api_keys={k: secret-abc-123}"])
    assert "server.api_keys" in str(caught.value) and "secret-abc" not in str(caught.value)


def test_cfg_parallel_ranks_get_a_gpu_each_or_the_config_is_refused():
    assert load_config("tiny", ["engine.device=cuda", "engine.cfg_parallel_size=2", "policy.cfg_scale=5"]).engine.replica_device_lists() == [
        ["cuda:0", "cuda:1"]
    ]
    with pytest.raises(ConfigError, match=r"engine.cfg_parallel_size=2 puts 2 CFG ranks on cuda:0 .*engine.devices=\[cuda:0,cuda:1\]"):
        preflight(load_config("tiny", ["engine.device=cuda:0", "engine.cfg_parallel_size=2", "policy.cfg_scale=5"]), local=False)


def test_an_embodiment_a_checkpoint_lacks_is_refused_in_one_line_by_a_worker_too():
    """Preflight turns it into a ConfigError (a ValueError); a worker, which sees it for built-in
    checkpoints, logs a StartRefused as one line instead of a traceback."""
    from ardiff_policies.embodiment import EmbodimentError
    from ardiff_policies.errors import StartRefused

    error = EmbodimentError("policy.embodiment: experiment_cfg/metadata.json has no 'nope'")
    assert isinstance(error, ValueError) and isinstance(error, StartRefused)


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("engine.max_sesions=4", "engine.max_sesions: unknown key (from --set engine.max_sesions=4); did you mean engine.max_sessions?"),
        (
            "policy.num_inference_step=4",
            "policy.num_inference_step: unknown key (from --set policy.num_inference_step=4); did you mean policy.num_inference_steps?",
        ),
        ("engin.device=cpu", "engin: unknown key (from --set engin.device=cpu); did you mean engine?"),
        ("server.zzz=1", "server.zzz: unknown key (from --set server.zzz=1)"),  # nothing close: no guess
    ],
)
def test_an_unknown_key_from_the_command_line_says_so_and_suggests_the_nearest(override, line):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", [override])
    lines = str(info.value).splitlines()
    assert lines[1:] == [f"  {line}"], lines


def test_an_unknown_key_in_the_file_suggests_the_nearest_without_blaming_the_command_line(tmp_path):
    custom = tmp_path / "mine.yaml"
    custom.write_text("engine: {max_sesions: 4}\npolicy: {name: noop}\n")
    with pytest.raises(ConfigError) as info:
        load_config(custom, ["engine.max_batch=2"])
    assert str(info.value).splitlines()[1:] == ["  engine.max_sesions: unknown key; did you mean engine.max_sessions?"]


def test_a_bad_value_from_the_command_line_names_the_flag_but_never_a_key():
    with pytest.raises(ConfigError, match=r"server\.port: .*\(got 'eighty'\) \(from --set server\.port=eighty\)$"):
        load_config("tiny", ["server.port=eighty"])
    with pytest.raises(ConfigError, match=r"server\.port: .*\(got 70000\) \(from --port 70000\)$"):
        load_config("tiny", flags=[("server.port=70000", "--port 70000")])
    with pytest.raises(ConfigError) as caught:  # a section-level error names the overrides in it, keys hidden
        load_config("tiny", ["server.tls_key=/tmp/k.pem", "server.api_keys=[secret-abc-123]"])
    assert "--set server.api_keys=<hidden>" in str(caught.value) and "secret-abc" not in str(caught.value)


def test_set_with_a_space_instead_of_equals_is_one_line_showing_key_equals_value(capsys):
    from ardiff_server import cli

    for argv, shown in (
        (["--set", "engine.max_sessions", "4"], "--set engine.max_sessions=4"),
        (["--port", "1", "--set", "engine.max_sessions"], "--set engine.max_sessions=VALUE"),
    ):
        with pytest.raises(SystemExit) as exited:
            cli.parse_args(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert shown in err and "usage:" not in err
    assert cli.parse_args(["--set", "engine.max_sessions=4"]).overrides == ["engine.max_sessions=4"]
