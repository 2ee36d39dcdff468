"""Configuration: sizes with units, and the precedence defaults < TOML < SPARSEKV_* env <
command line, where each value came from, and the flags' help (the subprocess check of
``--print-config`` is in test_main.py)."""

import dataclasses
import tomllib

import pytest

from sparsekv.daemon.config import (
    Config,
    ConfigError,
    env_name,
    format_size,
    load,
    load_with_sources,
    parse_size,
)
from sparsekv.daemon.main import build_parser


@pytest.mark.parametrize(
    "text, nbytes",
    [("256MiB", 256 << 20), ("64GiB", 64 << 30), ("1.5GiB", 3 << 29), ("2g", 2 * 10**9), ("4096B", 4096),
     (" 8 KiB ", 8192), ("1TiB", 1 << 40), ("10b", 10)],
)
def test_parse_size_units(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "12XB", "-5MiB", "MiB", "1.2.3GiB", "5 Mi B", True])
def test_parse_size_rejects_bad_text_with_an_example(text):
    with pytest.raises(ValueError, match="256MiB"):
        parse_size(text)


@pytest.mark.parametrize("text", ["1073741824", 1073741824, " 64 ", 0])
def test_a_size_without_a_unit_is_an_error(text):
    with pytest.raises(ValueError, match="has no unit"):
        parse_size(text)


@pytest.mark.parametrize("text, nbytes", [("4096", 4096), (77, 77)])
def test_a_bare_byte_count_is_allowed_where_asked(text, nbytes):
    assert parse_size(text, unit_required=False) == nbytes
    with pytest.raises(ValueError, match="whole number"):
        parse_size("1.5", unit_required=False)


@pytest.mark.parametrize(
    "toml, env, words",
    [
        ('pool_size = "1073741824"', {}, "config file"),
        ("pool_size = 1073741824", {}, "config file"),
        ('device_arena_size = 64', {}, "config file"),
        ("", {"SPARSEKV_POOL_SIZE": "1073741824"}, "environment SPARSEKV_POOL_SIZE"),
    ],
)
def test_a_size_without_a_unit_in_a_file_or_env_names_the_key(tmp_path, toml, env, words):
    path = tmp_path / "d.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as ei:
        load(build_parser().parse_args(["--config", str(path)]), environ=env)
    msg = str(ei.value)
    assert words in msg and "has no unit" in msg
    assert ("device_arena_size" if "arena" in toml else "pool_size") in msg


def test_a_size_on_the_command_line_needs_a_unit_too():
    # bench/private_daemon.py passes exact byte counts with a "B"
    assert load(build_parser().parse_args(["--pool-size", "67108864B"]), environ={}).pool_size == 64 << 20
    with pytest.raises(ConfigError, match="pool_size"):
        load(build_parser().parse_args(["--pool-size", "67108864"]), environ={})


def test_format_size():
    assert [format_size(n) for n in (1 << 30, 3 << 20, 1536, 100)] == ["1GiB", "3MiB", "1.5KiB", "100B"]


def test_defaults(monkeypatch):
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    c = load(build_parser().parse_args([]), environ={})
    assert c == Config(run_dir="/run/sparsekv")
    assert c.pool_size == 1 << 30 and c.backend == "auto"


def test_run_dir_default_comes_from_runtime_directory(monkeypatch):
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/a:/run/b")  # systemd: colon-separated
    assert load(None, environ={}).run_dir == "/run/a"


def test_precedence_defaults_toml_env_command_line(tmp_path):
    toml = tmp_path / "d.toml"
    toml.write_text('[sparsekvd]\npool_size = "128MiB"\nmax_clients = 10\nreap_interval_s = 3.0\nlog_level = "debug"\n')
    env = {"SPARSEKV_MAX_CLIENTS": "20", "SPARSEKV_REAP_INTERVAL_S": "4"}
    args = build_parser().parse_args(["--config", str(toml), "--reap-interval-s", "5", "--run-dir", "/x"])
    c = load(args, environ=env)
    assert c.pool_size == 128 << 20  # TOML over default
    assert c.log_level == "debug"  # TOML over default
    assert c.max_clients == 20  # env over TOML
    assert c.reap_interval_s == 5.0  # command line over env and TOML
    assert c.gather_blocks == Config().gather_blocks  # untouched default
    assert c.run_dir == "/x"


def test_toml_top_level_table_and_env_config_file(tmp_path):
    toml = tmp_path / "d.toml"
    toml.write_text('backend = "cpu"\n')
    assert load(None, environ={"SPARSEKV_CONFIG": str(toml)}).backend == "cpu"


@pytest.mark.parametrize(
    "toml, env, words",
    [
        ('pool_size = "lots"', {}, "config file"),
        ("bogus = 1", {}, "unknown setting 'bogus'"),
        ("pool_size = [", {}, "not valid TOML"),
        ("", {"SPARSEKV_MAX_CLIENTS": "many"}, "environment SPARSEKV_MAX_CLIENTS"),
        ("", {"SPARSEKV_BACKEND": "tpu"}, "backend must be auto, cpu or cuda"),
        ("", {"SPARSEKV_POOL_SIZE": "0B"}, "pool_size must be positive"),
        ("", {"SPARSEKV_DEVICES": "0,x"}, "devices must be"),
        ("", {"SPARSEKV_REAP_INTERVAL_S": "0"}, "reap_interval_s"),
    ],
)
def test_bad_settings_name_the_setting_and_its_source(tmp_path, toml, env, words):
    path = tmp_path / "d.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as ei:
        load(build_parser().parse_args(["--config", str(path)]), environ=env)
    assert words in str(ei.value)


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(build_parser().parse_args(["--config", str(tmp_path / "nope.toml")]), environ={})


def test_sources_say_where_each_value_came_from(tmp_path, monkeypatch):
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    toml = tmp_path / "d.toml"
    toml.write_text('[sparsekvd]\npool_size = "128MiB"\nmax_clients = 10\n')
    env = {"SPARSEKV_MAX_CLIENTS": "20", "SPARSEKV_BACKEND": "cpu"}
    cfg, src = load_with_sources(build_parser().parse_args(["--config", str(toml), "--ring-depth", "4"]), environ=env)
    assert src["pool_size"] == f"file {toml}"
    assert src["max_clients"] == "env SPARSEKV_MAX_CLIENTS" and cfg.max_clients == 20
    assert src["backend"] == "env SPARSEKV_BACKEND"
    assert src["ring_depth"] == "flag --ring-depth" and cfg.ring_depth == 4
    assert src["gather_blocks"] == "default" and src["run_dir"] == "default"
    text = cfg.to_toml(src)
    assert tomllib.loads(text)["max_clients"] == 20  # still TOML: the sources are comments
    line = {ln.split(" ")[0]: ln for ln in text.splitlines() if not ln.startswith("#")}
    assert line["max_clients"].endswith("# env SPARSEKV_MAX_CLIENTS")
    assert line["pool_size"].endswith(f"# file {toml}")
    assert line["ring_depth"].endswith("# flag --ring-depth")
    assert line["shm_dir"].endswith("# default")


def test_run_dir_from_runtime_directory_says_so(monkeypatch):
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/a")
    cfg, src = load_with_sources(None, environ={})
    assert cfg.run_dir == "/run/a" and "RUNTIME_DIRECTORY" in src["run_dir"]


def test_every_setting_has_one_flag_with_help_its_default_and_its_env_name():
    parser = build_parser()
    by_dest = {a.dest: a for a in parser._actions}
    for f in dataclasses.fields(Config):
        action = by_dest[f.name]
        assert action.option_strings == [f"--{f.name.replace('_', '-')}"]
        assert action.default is None  # "not given": the file and the environment apply
        assert "(default: " in action.help and f"env {env_name(f.name)})" in action.help, action.help
    for a in parser._actions:
        if a.dest != "help":
            assert a.help, a.dest


def test_metrics_port_is_off_by_default_and_checked():
    assert Config().metrics_port == 0
    assert load(build_parser().parse_args(["--metrics-port", "9464"]), environ={}).metrics_port == 9464
    with pytest.raises(ConfigError, match="metrics_port"):
        load(None, environ={"SPARSEKV_METRICS_PORT": "70000"})


def test_to_toml_round_trips_through_load(tmp_path):
    c = Config(backend="cpu", run_dir="/r", pool_size=3 << 20, max_clients=7, reap_interval_s=0.5)
    path = tmp_path / "c.toml"
    path.write_text(c.to_toml())
    assert load(build_parser().parse_args(["--config", str(path)]), environ={}) == c
