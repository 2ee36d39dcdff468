"""What ``sparsekvd`` names at start without refusing it: settings the cpu backend ignores,
a limit another setting makes moot, a pool off the 2 MiB grain, an ``admin_gid`` of no
group (each line with where the setting came from)."""

from __future__ import annotations

import grp
import subprocess

import pytest

from sparsekv.daemon.backends import backend_unusable, cuda_probe

from sparsekvd_proc import DAEMON, clean_env, run_dir, start_and_stop_log  # noqa: F401 (a fixture)


def test_the_cpu_backend_names_the_cuda_settings_it_ignores(run_dir):
    """Found by an operator's review: --devices, --gather-blocks and the like were taken
    without a word on the cpu backend."""
    text = start_and_stop_log(run_dir, "--devices", "0,1", "--gather-blocks", "5", "--shm-dir", "/dev/shm",
                              env=clean_env(SPARSEKV_RING_DEPTH="4"))
    assert ("the cpu backend ignores the cuda settings given: devices (flag --devices), gather_blocks "
            "(flag --gather-blocks), ring_depth (env SPARSEKV_RING_DEPTH)") in text, text


def test_a_limit_another_setting_makes_moot_is_named_by_print_config_and_at_start(run_dir):
    """Found by an operator's review: max_clients_per_uid above max_clients was taken
    without a word; the start still goes ahead (the smaller limit binds)."""
    flags = ["--max-clients", "4", "--max-clients-per-uid", "5"]
    line = "max_clients_per_uid 5 (flag --max-clients-per-uid) is more than max_clients 4 (flag --max-clients)"
    r = subprocess.run([*DAEMON, "--backend", "cpu", "--run-dir", run_dir, "--pool-size", "64MiB", *flags,
                        "--print-config"], capture_output=True, text=True, timeout=30, env=clean_env())
    assert r.returncode == 0 and line in r.stderr, r.stderr
    text = start_and_stop_log(run_dir, *flags)
    assert line in text, text


def test_a_pool_size_off_the_2mib_grain_is_named_at_start(run_dir):
    """Found by an operator's review: 3000001B was taken without a word; engine ranges are
    whole 2 MiB pieces of the pool, so its last 881.7KiB are never used."""
    text = start_and_stop_log(run_dir, pool="3000001B")
    assert "pool_size 2.9MiB (flag --pool-size) is not a multiple of 2MiB: its last 881.7KiB never hold" in text, text


def test_an_admin_gid_of_no_group_is_named_at_start(run_dir):
    gid = 64999
    while True:  # a gid this host has no group for
        try:
            grp.getgrgid(gid)
            gid -= 1
        except KeyError:
            break
    text = start_and_stop_log(run_dir, "--admin-gid", str(gid))
    assert f"admin_gid {gid} (flag --admin-gid) names no group on this host" in text, text


def test_print_config_with_backend_auto_and_no_gpu_names_the_cuda_settings_it_would_ignore(run_dir):
    """Found by an operator's review: with ``backend = "auto"`` on a machine without a GPU,
    ``--print-config`` said nothing of the cpu backend it would start, nor of the cuda
    settings that start ignores (the start itself logs both)."""
    probe = cuda_probe()
    if probe[0] is None or backend_unusable("auto", probe, source="default") is not None:
        pytest.skip("this machine has a GPU: auto would not start the cpu backend")
    r = subprocess.run([*DAEMON, "--backend", "auto", "--run-dir", run_dir, "--pool-size", "64MiB", "--devices",
                        "0", "--print-config"], capture_output=True, text=True, timeout=30, env=clean_env())
    assert r.returncode == 0, r.stderr
    assert "backend auto (flag --backend): no NVIDIA GPU on this machine; the start would use the cpu backend" \
        in r.stderr, r.stderr
    assert "the cpu backend ignores the cuda settings given: devices (flag --devices)" in r.stderr, r.stderr
