"""Settings that could slip through: nan / inf / negative seconds (nan would mean "never
reap"), a TOML float or bool truncated to an int setting, text settings given as
numbers, tables where settings belong, a missing ``shm_dir`` found only at the first
attach; each is one clear line naming the setting and its source, and sparsekvd exits 2
before touching anything."""

import os
import subprocess

import pytest

import helpers
from sparsekv.daemon.config import ConfigError, load
from sparsekv.daemon.main import build_parser

DAEMON = [helpers.PY, "-m", "sparsekv.daemon.main"]


def load_toml(tmp_path, text, env=None, args=()):
    path = tmp_path / "d.toml"
    path.write_text(text)
    return load(build_parser().parse_args(["--config", str(path), *args]), environ=env or {})


@pytest.mark.parametrize("toml, env, args, words", [
    ("reap_interval_s = nan", {}, [], "bad value for reap_interval_s: nan is not a finite number"),
    ("reap_interval_s = inf", {}, [], "bad value for reap_interval_s: inf is not a finite number"),
    ("reap_interval_s = -1.0", {}, [], "reap_interval_s must be in (0.01, 3600], got -1.0"),
    ("reap_interval_s = 1e-7", {}, [], "reap_interval_s must be in (0.01, 3600], got 1e-07"),
    ("", {"SPARSEKV_REAP_INTERVAL_S": "nan"}, [], "environment SPARSEKV_REAP_INTERVAL_S: bad value"),
    ("", {"SPARSEKV_REAP_INTERVAL_S": "-inf"}, [], "not a finite number"),
    ("", {}, ["--reap-interval-s", "nan"], "--reap-interval-s: bad value"),
    ("", {}, ["--reap-interval-s", "1e9"], "reap_interval_s must be"),
    ("max_clients = 2.7", {}, [], "bad value for max_clients: an integer is needed, got a float 2.7"),
    ("max_clients = true", {}, [], "an integer is needed, got a boolean"),
    ("max_clients = 0", {}, [], "max_clients must be in [1, 1000000], got 0"),
    ("", {"SPARSEKV_MAX_CLIENTS": "2.7"}, [], "environment SPARSEKV_MAX_CLIENTS: bad value"),
    # ASCII digits only, no underscores (found by an adversarial review: int() and \d took both)
    ("", {"SPARSEKV_MAX_CLIENTS": "1_0"}, [], "an integer is needed, got '1_0'"),
    ("", {"SPARSEKV_CONFIG": "/nonexistent.toml"}, ["--config", ""], "flag --config: an empty path"),
    ("", {}, ["--pool-size", "\u0666\u0664MiB"], "bad size"),
    ("", {}, ["--io-cpus", "\u0661"], "is not a CPU number or range"),
    ("", {"SPARSEKV_REAP_INTERVAL_S": "1_0.5"}, [], "a number is needed, got '1_0.5'"),
    ("ring_depth = [8]", {}, [], "an integer is needed, got an array"),
    ("reap_interval_s = true", {}, [], "a number is needed, got a boolean"),
    ("shm_dir = 5", {}, [], "bad value for shm_dir: text is needed, got an integer"),
    ("backend = false", {}, [], "text is needed, got a boolean"),
    ("pool_size = 1.5", {}, [], "a size is text with a unit"),
    ("max_slab_bytes = \"0B\"", {}, [], "max_slab_bytes must be positive"),
    ("prefault_threads = -2", {}, [], "prefault_threads must be in [0, 1024]"),
    ("pool_size = \"64G\"", {}, [], "bad value for pool_size: size '64G' is ambiguous: write 64GiB"),
    ("", {"SPARSEKV_ADMIN_GID": "-2"}, [], "environment SPARSEKV_ADMIN_GID: admin_gid must be in [-1, "),
    # Found by an operator's review: accepted, then every attach refused or every client dropped
    ('pool_size = "4097B"', {}, [], "pool_size must be >= 2MiB, got 4097B"),
    ("", {}, ["--hello-timeout-s", "0.0001"], "hello_timeout_s must be in (0.1, 86400], got 0.0001"),
    ("idle_timeout_s = 0", {}, [], "idle_timeout_s must be in (0.1, 86400], got 0"),
    ('run_dir = "relative/dir"', {}, [], "run_dir must be an absolute path, got 'relative/dir' (a relative one"),
    ('kernel_cache_dir = "cache"', {}, [], "kernel_cache_dir must be an absolute path"),
])
def test_bad_numbers_and_types_are_errors(tmp_path, toml, env, args, words):
    with pytest.raises(ConfigError) as ei:
        load_toml(tmp_path, toml, env, args)
    assert words in str(ei.value)
    assert "\n" not in str(ei.value)


def test_numbers_of_the_right_kind_still_load(tmp_path):
    cfg = load_toml(tmp_path, 'reap_interval_s = 1\nmax_clients = 7\nmax_slab_bytes = "1GiB"\n',
                    {"SPARSEKV_RING_DEPTH": " 4 "})
    assert (cfg.reap_interval_s, cfg.max_clients, cfg.max_slab_bytes, cfg.ring_depth) == (1.0, 7, 1 << 30, 4)
    # a choice written as a TOML integer, as io_cpus may be
    assert load_toml(tmp_path, "pin_pool_at_start = 0\n").pin_pool_at_start == "0"
    with pytest.raises(ConfigError, match="pin_pool_at_start must be 1, after or 0, got '2'"):
        load_toml(tmp_path, "pin_pool_at_start = 2\n")
    # a relative directory is the command line's business (the shell's working directory), not a file's;
    # either is made absolute, and ~ expanded, so that --print-config reads back as the same settings
    assert load_toml(tmp_path, "", {}, ["--run-dir", "rel"]).run_dir == os.path.abspath("rel")
    assert load_toml(tmp_path, "", {"SPARSEKV_SHM_DIR": "~/shm"}).shm_dir == os.path.expanduser("~/shm")
    assert load_toml(tmp_path, 'run_dir = "~/k"\n').run_dir == os.path.expanduser("~/k")


@pytest.mark.parametrize("toml, words", [
    ("[foo]\nbar = 1\n", "unknown table [foo]"),
    ("[[sparsekvd]]\nmax_clients = 1\n", "sparsekvd must be a table ([sparsekvd]), got an array"),
    ("sparsekvd = 3\n", "sparsekvd must be a table ([sparsekvd]), got an integer"),
    ("pool_size = \"1GiB\"\n[sparsekvd]\nmax_clients = 3\n", "['pool_size'] outside the table [sparsekvd]"),
    ("[sparsekvd]\n[sparsekvd.backend]\nx = 1\n", "setting backend cannot be a table"),
    ("[[servers]]\nname = 1\n", "unknown table [[servers]]"),
    ("[sparsekvd]\n[[sparsekvd.arr]]\nx = 1\n", "unknown table [[sparsekvd.arr]]"),
    ("[sparsekvd]\n[sparsekvd.extra]\nx = 1\n", "unknown table [sparsekvd.extra]"),  # as the file names it
])
def test_tables_where_settings_belong_are_one_line_errors(tmp_path, toml, words):
    with pytest.raises(ConfigError) as ei:
        load_toml(tmp_path, toml)
    assert words in str(ei.value) and "\n" not in str(ei.value)


def test_sparsekvd_with_a_non_table_section_exits_2_with_one_line(tmp_path):
    path = tmp_path / "d.toml"
    path.write_text("[foo]\nbar = 1\n")
    run_dir = str(tmp_path / "run")
    r = subprocess.run([*DAEMON, "--backend", "cpu", "--run-dir", run_dir, "--config", str(path)],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [f"sparsekvd: config file {path}: unknown table [foo]; settings are plain "
                                             "keys (at the top level or in [sparsekvd])"]
    assert not os.path.exists(run_dir)


def test_missing_shm_dir_is_refused_at_start(tmp_path):
    run_dir = str(tmp_path / "run")
    r = subprocess.run([*DAEMON, "--backend", "cpu", "--run-dir", run_dir, "--pool-size", "16MiB",
                        "--shm-dir", str(tmp_path / "nope")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"shm_dir {tmp_path / 'nope'} (flag --shm-dir) does not exist" in r.stderr
    assert not os.path.exists(run_dir)  # before the lock, the pool, anything
    # --print-config still shows the settings, and says the start would be refused (exit 2)
    r = subprocess.run([*DAEMON, "--shm-dir", str(tmp_path / "nope"), "--print-config"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "shm_dir" in r.stdout
    assert f"would not start: shm_dir {tmp_path / 'nope'} (flag --shm-dir) does not exist" in r.stderr


def test_print_config_runs_the_starts_checks_that_make_nothing(tmp_path):
    """Found by an operator's review: --print-config exited 0 for settings the start then
    refused (a pool over the RAM, a run dir that is a file, CPUs it may not use), so a
    file checked with it failed under systemd. It still makes, locks and starts nothing."""
    import psutil

    plain = tmp_path / "file"
    plain.write_text("")
    over = psutil.virtual_memory().total + (1 << 30)
    r = subprocess.run([*DAEMON, "--backend", "cpu", "--run-dir", str(plain), "--pool-size", f"{over}B",
                        "--io-cpus", "1000", "--print-config"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "pool_size" in r.stdout and "Traceback" not in r.stderr, r.stderr
    assert f"would not start: run dir {plain} is not a directory (run_dir: flag --run-dir)" in r.stderr
    assert "would not start: pool_size" in r.stderr and "more than this machine's RAM" in r.stderr
    assert "would not start:" in r.stderr and "(io_cpus: flag --io-cpus)" in r.stderr
    run_dir = tmp_path / "deep" / "run"
    r = subprocess.run([*DAEMON, "--backend", "cpu", "--run-dir", str(run_dir), "--pool-size", "16MiB",
                        "--print-config"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and r.stderr == "" and not (tmp_path / "deep").exists()  # nothing made


def test_a_run_dir_the_daemon_cannot_write_is_a_setting_refused(tmp_path, monkeypatch):
    """Found by an operator's review: an existing run dir the daemon may not write (an
    immutable one) gave a bare '[Errno 1] Operation not permitted' and exit 1 (retried).
    (The refusals are faked: root writes a 0555 directory.)"""
    import errno

    from sparsekv.daemon import run_dir_lock as lock_mod

    run = tmp_path / "ro"
    run.mkdir()
    real_open = os.open

    def refused(path, *a, **kw):
        if str(path).endswith("sparsekvd.lock"):
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return real_open(path, *a, **kw)

    monkeypatch.setattr(lock_mod.os, "open", refused)
    with pytest.raises(lock_mod.SettingRefused, match="cannot make its lock file .*: Operation not permitted: the "
                       "run dir must be writable"):
        lock_mod.RunDirLock(str(run))
    monkeypatch.setattr(lock_mod.os, "access", lambda path, mode: False)
    assert lock_mod.run_dir_refusal(str(run)) == (f"run dir {run} is not writable by this daemon's user", 2)
    with pytest.raises(lock_mod.SettingRefused, match="is not writable by this daemon's user"):
        lock_mod.RunDirLock(str(run))  # (before any lock file is opened: not at the sockets, minutes later)
    assert lock_mod.run_dir_refusal(str(run / "sub")) == (f"run dir {run / 'sub'} cannot be made: {run} is not "
                                                          "writable by this user", 1)  # (the start's mkdir: exit 1)


@pytest.mark.parametrize("case", ["dangling_run_dir", "dangling_parent", "lock_link", "lock_dir", "socket_dir"])
def test_print_config_and_the_start_agree_on_a_run_dir(tmp_path, case):
    """Found by a review of the first --print-config checks: a dangling link as the run dir
    was a traceback; the lock file was not looked at; a lock file, or a socket's path, that
    is a directory was a bare EISDIR at start (the socket's after the pre-fault)."""
    run = tmp_path / "run"
    if case == "dangling_run_dir":
        run.symlink_to(tmp_path / "nowhere")
    elif case == "dangling_parent":
        (tmp_path / "link").symlink_to(tmp_path / "nowhere")
        run = tmp_path / "link" / "run"
    else:
        run.mkdir()
        lock = run / "sparsekvd.lock"
        if case == "lock_link":
            (tmp_path / "f").write_text("")
            lock.symlink_to(tmp_path / "f")
        elif case == "lock_dir":
            lock.mkdir()
        else:  # a directory where a socket goes: a bare EISDIR after the pre-fault before
            (run / "stats.sock").mkdir()
    args = [*DAEMON, "--backend", "cpu", "--run-dir", str(run), "--pool-size", "16MiB"]
    checked = subprocess.run([*args, "--print-config"], capture_output=True, text=True, timeout=30)
    started = subprocess.run(args, capture_output=True, text=True, timeout=30)
    assert "Traceback" not in checked.stderr + started.stderr, checked.stderr + started.stderr
    want = 1 if case == "dangling_parent" else 2
    assert checked.returncode == started.returncode == want, (checked.stderr, started.stderr)


def test_sparsekvd_takes_no_abbreviated_flag():
    """Found by an operator's review: --pool-s and --print-conf were taken; a unit written
    so would change meaning, or stop, once a setting with the same start is added."""
    for argv in (["--pool-s", "128MiB"], ["--print-conf"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
    assert build_parser().parse_args(["--pool-size", "128MiB"]).pool_size == "128MiB"
