"""Configuration: sizes with units, and the precedence defaults < TOML < SPARSEKV_* env <
command line (the subprocess check of ``--print-config`` is in test_main.py)."""

import pytest

from sparsekv.daemon.config import Config, ConfigError, format_size, load, parse_size
from sparsekv.daemon.main import build_parser


@pytest.mark.parametrize(
    "text, nbytes",
    [("256MiB", 256 << 20), ("64GiB", 64 << 30), ("1.5GiB", 3 << 29), ("2g", 2 * 10**9), ("4096", 4096),
     (" 8 KiB ", 8192), ("1TiB", 1 << 40), ("10b", 10), (77, 77)],
)
def test_parse_size_units(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "12XB", "-5MiB", "MiB", "1.2.3GiB", "5 Mi B"])
def test_parse_size_rejects_bad_text_with_an_example(text):
    with pytest.raises(ValueError, match="256MiB"):
        parse_size(text)


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
        ("", {"SPARSEKV_POOL_SIZE": "0"}, "pool_size must be positive"),
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


def test_to_toml_round_trips_through_load(tmp_path):
    c = Config(backend="cpu", run_dir="/r", pool_size=3 << 20, max_clients=7, reap_interval_s=0.5)
    path = tmp_path / "c.toml"
    path.write_text(c.to_toml())
    assert load(build_parser().parse_args(["--config", str(path)]), environ={}) == c
