"""Configuration: the precedence defaults < TOML < SPARSEKV_* env < command line, where
each value came from, debug switches, and the flags' help (sizes' units are checked in
tests/proto/test_settings.py; the subprocess check of ``--print-config`` is in
test_main.py)."""

import dataclasses
import os
import re
import tomllib
from pathlib import Path

import pytest

from sparsekv.daemon import config
from sparsekv.daemon.config import Config, ConfigError, env_name, load, load_with_sources, unknown_env
from sparsekv.daemon.blocks.store import BlockStore
from sparsekv.daemon.main import build_parser
from sparsekv.daemon.store_room import StoreRoom, least_store_bytes, session_bytes
from sparsekv.proto import ErrorCode, ProtocolError
from sparsekv.proto.settings import format_size


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


def test_defaults(monkeypatch):
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    c = load(build_parser().parse_args([]), environ={})
    assert c == Config(run_dir="/run/sparsekv")
    assert c.pool_size == 1 << 30 and c.backend == "auto"


def test_run_dir_default_comes_from_runtime_directory():
    assert load(None, environ={"RUNTIME_DIRECTORY": "/run/a:/run/b"}).run_dir == "/run/a"  # systemd: colon-separated
    assert load(None, environ={"RUNTIME_DIRECTORY": "/run/a", "SPARSEKV_RUN_DIR": "/x"}).run_dir == "/x"


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
        ('pool_sise = "1GiB"', {}, "unknown setting 'pool_sise' (did you mean pool_size?)"),  # as the environment's
        ('Pool_Size = "1GiB"', {}, "unknown setting 'Pool_Size' (did you mean pool_size?)"),
        ("pool_size = [", {}, "not valid TOML"),
        ("", {"SPARSEKV_MAX_CLIENTS": "many"}, "environment SPARSEKV_MAX_CLIENTS"),
        ("", {"SPARSEKV_BACKEND": "tpu"}, "backend must be auto, cpu or cuda"),
        ("", {"SPARSEKV_POOL_SIZE": "0B"}, "environment SPARSEKV_POOL_SIZE: pool_size must be >= 2MiB, got 0B"),
        ("", {"SPARSEKV_POOL_SIZE": "1G"}, "environment SPARSEKV_POOL_SIZE: bad value for pool_size: size '1G' is "
         "ambiguous"),
        ("", {"SPARSEKV_MAX_CLIENTS": "abc"}, "environment SPARSEKV_MAX_CLIENTS: bad value for max_clients: an "
         "integer is needed, got 'abc'"),
        ("", {"SPARSEKV_POOL_BACKING": "hugetlbfs"}, "pool_backing must be anon_thp or memfd, got 'hugetlbfs'"),
        ("", {"SPARSEKV_PIN_POOL_AT_START": "yes"}, "pin_pool_at_start must be 1, after or 0, got 'yes'"),
        ("", {"SPARSEKV_PIN_CHUNK_GIB": "-1"}, "environment SPARSEKV_PIN_CHUNK_GIB: pin_chunk_gib must be in"),
        ("", {"SPARSEKV_PIN_CHUNK_GIB": "x"}, "SPARSEKV_PIN_CHUNK_GIB: bad value for pin_chunk_gib: a number"),
        ("", {"SPARSEKV_CUDA_GRAPHS": "maybe"}, "SPARSEKV_CUDA_GRAPHS: bad value for cuda_graphs: 1 or 0"),
        ("cuda_graphs = 0", {}, "bad value for cuda_graphs: true or false is needed, got an integer 0"),
        ("", {"SPARSEKV_DEVICES": "0,x"}, "devices must be"),
        ("", {"SPARSEKV_WARM_ROW_BYTES": "656,100"}, "warm_row_bytes must be a comma list of positive multiples of 16"),
        ('warm_row_bytes = "656,"', {}, "warm_row_bytes must be a comma list"),
        ("", {"SPARSEKV_REAP_INTERVAL_S": "0"}, "reap_interval_s"),
        ("", {"SPARSEKV_POOL_SIZE": "1" * 400 + "B"}, "environment SPARSEKV_POOL_SIZE: bad value for pool_size: size"),
        ('pool_size = "1.5B"', {}, "pool_size: size '1.5B' is not a whole number of bytes"),
        ("", {"SPARSEKV_INFLIGHT_BYTES": "67108863B"}, "inflight_bytes must be >= 64MiB, got 67108863B"),
        ('run_dir = ""', {}, "run_dir must name a directory, got ''"),
        ("", {"SPARSEKV_KERNEL_CACHE_DIR": " "}, "kernel_cache_dir must name a directory"),
        ("", {"SPARSEKV_SHM_DIR": "/tmp/d\udcff"}, "shm_dir must be UTF-8 text"),  # an undecodable byte
    ],
)
def test_bad_settings_name_the_setting_and_its_source(tmp_path, toml, env, words):
    path = tmp_path / "d.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as ei:
        load(build_parser().parse_args(["--config", str(path)]), environ=env)
    assert words in str(ei.value) and "\n" not in str(ei.value)


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


def test_run_dir_from_runtime_directory_says_so():
    cfg, src = load_with_sources(None, environ={"RUNTIME_DIRECTORY": "/run/a"})
    assert cfg.run_dir == "/run/a" and "RUNTIME_DIRECTORY" in src["run_dir"]


def test_an_empty_variable_is_an_unset_one():
    cfg, src = load_with_sources(None, environ={"SPARSEKV_MAX_CLIENTS": "", "SPARSEKV_KERNEL_CACHE_DIR": ""})
    assert cfg.max_clients == 256 and src["max_clients"] == "default"
    assert cfg.kernel_cache_dir == os.path.expanduser("~/.cache/sparsekv/kernels")


def test_the_pool_and_page_lock_settings():
    cfg = load(None, environ={"SPARSEKV_POOL_BACKING": "memfd", "SPARSEKV_PIN_POOL_AT_START": "after",
                              "SPARSEKV_PIN_CHUNK_GIB": "0.002"})
    assert (cfg.pool_backing, cfg.pin_pool_at_start, cfg.pin_chunk_bytes) == ("memfd", "after", 2 << 20)
    assert Config().pin_chunk_bytes == 4 << 30
    assert Config(pin_chunk_gib=0.0001).pin_chunk_bytes == 2 << 20  # at least one 2 MiB page
    assert Config(pin_chunk_gib=16).pin_chunk_bytes == 16 << 30


def test_cuda_graphs_is_a_debug_switch_marked_in_help_and_print_config(tmp_path):
    assert Config().cuda_graphs is True
    for env, flag, want in (({"SPARSEKV_CUDA_GRAPHS": "0"}, [], False), ({}, ["--cuda-graphs", "off"], False),
                            ({"SPARSEKV_CUDA_GRAPHS": "0"}, ["--cuda-graphs", "1"], True)):
        assert load(build_parser().parse_args(flag), environ=env).cuda_graphs is want
    path = tmp_path / "d.toml"
    path.write_text("cuda_graphs = false\n")
    cfg, src = load_with_sources(build_parser().parse_args(["--config", str(path)]), environ={})
    assert cfg.cuda_graphs is False
    line = next(ln for ln in cfg.to_toml(src).splitlines() if ln.startswith("cuda_graphs"))
    assert line.startswith("cuda_graphs = false") and line.endswith(f"# file {path} (debug switch)")
    debug = [a for a in build_parser()._actions if a.help and a.help.startswith("debug switch: ")]
    assert [a.dest for a in debug] == ["cuda_graphs"]


def test_a_flag_is_parsed_as_its_variable_is():
    with pytest.raises(ConfigError, match="flag --max-clients: bad value for max_clients: an integer is needed"):
        load(build_parser().parse_args(["--max-clients", "abc"]), environ={})
    with pytest.raises(ConfigError, match="--ring-depth: ring_depth must be in \\[1, 1024\\], got 0"):
        load(build_parser().parse_args(["--ring-depth", "0"]), environ={})


def test_sizes_print_in_the_largest_unit_and_read_back_exactly(tmp_path):
    c = Config(pool_size=64 * 10**9, device_arena_size=3 << 30, max_slab_bytes=(1 << 30) + 1)
    text = c.to_toml()
    assert 'pool_size = "64GB"' in text and 'device_arena_size = "3GiB"' in text
    assert f'max_slab_bytes = "{(1 << 30) + 1}B"' in text  # no unit holds it whole: exact bytes
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert load(build_parser().parse_args(["--config", str(path)]), environ={}) == c


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
    c = Config(backend="cpu", run_dir="/r", pool_size=3 << 20, max_clients=7, reap_interval_s=0.5,
               pool_backing="memfd", pin_pool_at_start="after", pin_chunk_gib=0.5, cuda_graphs=False)
    path = tmp_path / "c.toml"
    path.write_text(c.to_toml())
    assert load(build_parser().parse_args(["--config", str(path)]), environ={}) == c


def test_the_sample_file_shows_each_default_it_comments_out(tmp_path):
    text = (Path(__file__).parents[2] / "deploy" / "sparsekvd.toml").read_text()
    shown = re.findall(r"^# (\w+ = \S+)", text, re.M)
    names = {line.split(" ")[0] for line in shown}
    assert names >= {"pool_backing", "pin_pool_at_start", "pin_chunk_gib", "cuda_graphs"}
    path = tmp_path / "one.toml"
    for line in shown:
        path.write_text(line + "\n")
        assert load(build_parser().parse_args(["--config", str(path)]), environ={}) == load(None, environ={}), line


def test_per_uid_client_and_connection_caps_are_on_by_default_and_sized_from_max_clients():
    """One uid must not lock out the others out of the box: a quarter of the client places
    (at least 1), twice that in connections (at least 16); 0 turns a cap off, a number sets it."""
    c = load(build_parser().parse_args([]), environ={})
    assert (c.max_clients_per_uid, c.max_connections_per_uid) == (-1, -1)
    assert (c.uid_client_cap, c.uid_connection_cap) == (64, 128)
    small = load(build_parser().parse_args(["--max-clients", "3"]), environ={})
    assert (small.uid_client_cap, small.uid_connection_cap) == (1, 16)
    off = load(build_parser().parse_args(["--max-clients-per-uid", "0", "--max-connections-per-uid", "0"]),
               environ={})
    assert (off.uid_client_cap, off.uid_connection_cap) == (0, 0)
    assert load(build_parser().parse_args(["--max-clients-per-uid", "0"]), environ={}).uid_connection_cap == 512
    set_ = load(build_parser().parse_args(["--max-clients-per-uid", "5", "--max-connections-per-uid", "7"]),
                environ={})
    assert (set_.uid_client_cap, set_.uid_connection_cap) == (5, 7)


def test_print_config_escapes_control_characters_so_that_it_reads_back(tmp_path):
    c = Config(run_dir="/r", shm_dir="/tmp/a\nb\tc\x1b\"d\\", kernel_cache_dir="/k\x7f\u2028k")
    text = c.to_toml()
    assert len(text.splitlines()) == len(dataclasses.fields(Config))  # one line a setting
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert load(build_parser().parse_args(["--config", str(path)]), environ={}) == c


def test_a_misspelt_variable_is_named_in_the_log_and_the_printed_config(monkeypatch, capsys):
    """Found by an operator's review: SPARSEKV_POOL_SISE was ignored without a word (the TOML
    file refuses an unknown key). The environment is shared with clients and tools: their
    variables (proto/settings.py) and empty ones are not named."""
    env = {"SPARSEKV_POOL_SISE": "2GiB", "SPARSEKV_POOL_SIZE": "1GiB", "SPARSEKV_KERNEL_CACHE_DIR": "/k",
           "SPARSEKV_CLIENT_DEVICE_WAIT": "1", "SPARSEKV_CONFIG": "", "SPARSEKV_NOTHING_LIKE_IT": "1",
           "SPARSEKV_IDLE_TIMEOUT_S_": "", "OTHER_POOL_SISE": "1",
           # the test tools' own (found by a review: SPARSEKV_LONG read as a misspelt SPARSEKV_CONFIG)
           "SPARSEKV_LONG": "1", "SPARSEKV_CLIENT_IO_CPUS": "1", "SPARSEKV_TEST_DAEMON_LOG": "/x",
           # a name that would break the TOML comment or forge a log line
           "SPARSEKV_POOL_SIZ\nE": "1"}
    assert unknown_env(env) == [
        "SPARSEKV_POOL_SISE is set but is no setting of sparsekvd (did you mean SPARSEKV_POOL_SIZE?): ignored",
        "'SPARSEKV_POOL_SIZ\\nE' is set but is no setting of sparsekvd (did you mean SPARSEKV_POOL_SIZE?): ignored"]
    from sparsekv.daemon import main as main_mod

    for name in [n for n in os.environ if n.startswith("SPARSEKV_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("SPARSEKV_MAX_CLIENT", "4")
    assert main_mod.main(["--print-config"]) == 0
    out = capsys.readouterr().out
    assert out.endswith("# SPARSEKV_MAX_CLIENT is set but is no setting of sparsekvd "
                        "(did you mean SPARSEKV_MAX_CLIENTS?): ignored\n")
    assert tomllib.loads(out)["max_clients"] == Config().max_clients  # still reads back


def test_limits_another_setting_makes_moot_are_named_with_their_sources():
    """Found by an operator's review: max_clients_per_uid above max_clients (and the like)
    was taken without a word."""
    cfg = Config(max_clients=8, max_clients_per_uid=9, pool_size=4 << 30, max_pool_bytes_per_uid=5 << 30,
                 backend="auto", max_slab_bytes=32 << 30, device_arena_size=16 << 30)
    lines = config.moot_settings(cfg, {"max_clients_per_uid": "flag --max-clients-per-uid",
                                        "pool_size": "file x.toml"})
    assert lines == [
        "max_clients_per_uid 9 (flag --max-clients-per-uid) is more than max_clients 8 (default): no uid reaches it",
        "max_pool_bytes_per_uid 5GiB (default) is more than pool_size 4GiB (file x.toml): no uid reaches it",
        "max_slab_bytes 32GiB (default) is more than device_arena_size 16GiB (default): a rank's attach is bounded "
        "by its GPU's arena"]
    # the cpu backend has no arena; equal limits, and the defaults, are not moot
    assert config.moot_settings(dataclasses.replace(cfg, backend="cpu", max_clients_per_uid=8,
                                                    max_pool_bytes_per_uid=4 << 30), {}) == []
    assert config.moot_settings(Config(), {}) == []


def test_a_store_cap_no_block_store_fits_is_named():
    """A max_store_bytes below the smallest store (one block, one rank) refused every
    attach with a block size, and was named only there."""
    least = least_store_bytes()
    cfg = Config(max_store_bytes=least - 1)
    assert config.moot_settings(cfg, {"max_store_bytes": "flag --max-store-bytes"}) == [
        f"max_store_bytes {format_size(least - 1)} (flag --max-store-bytes) is less than a block store of one block and one "
        f"rank takes ({least} bytes): every attach with a block size is refused"]
    # the uid's share below it: named with both settings
    cfg = Config(max_store_bytes=least, max_store_share_per_uid=0.5)
    assert config.moot_settings(cfg, {}) == [
        f"max_store_share_per_uid 0.5 (default) of max_store_bytes {format_size(least)} (default) is less than a block store "
        f"of one block and one rank takes ({least} bytes): every attach with a block size is refused"]
    # the smallest that fits, and no cap at all, are not named
    assert config.moot_settings(Config(max_store_bytes=least, max_store_share_per_uid=1), {}) == []
    assert config.moot_settings(Config(max_store_bytes=0), {}) == []


def test_the_least_store_is_what_the_room_counts_for_one_block_and_one_rank():
    """least_store_bytes is StoreRoom's own count of a one-block store with one session:
    a cap of exactly it lets that store in, one byte less refuses it."""
    least = least_store_bytes()
    assert least == BlockStore.bookkeeping_bytes(1) + session_bytes(1)
    assert StoreRoom(least, 1).yielding(least, 7, [], [], "an attach") == []
    with pytest.raises(ProtocolError) as e:
        StoreRoom(least - 1, 1).yielding(least, 7, [], [], "an attach")
    assert e.value.code == ErrorCode.POOL_FULL
