"""A private daemon that cannot start says why: the last lines it wrote on stderr end
the error (read from its pipe, or from its log file when it has one)."""

import pytest

from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.client.errors import DaemonUnavailable

MiB = 1 << 20


@pytest.mark.parametrize("with_log", [False, True])
def test_a_failed_start_shows_the_daemons_last_error_lines(daemon, tmp_path, with_log):
    log = str(tmp_path / "second.log") if with_log else None
    # A second daemon on the first one's run dir: it logs why it refuses and exits 1.
    second = PrivateDaemon(pool_bytes=64 * MiB, extra_args=["--run-dir", daemon.run_dir], log_path=log,
                           start_timeout_s=30)
    with pytest.raises(DaemonUnavailable) as ei:
        second.__enter__()
    msg = str(ei.value)
    assert msg.startswith("private sparsekvd exited with code 1: ")
    assert f"another sparsekvd (pid {daemon.proc.pid}) holds {daemon.run_dir}" in msg
    assert " INFO " not in msg  # its errors, not its start-up chatter
