"""The daemon's busy poll: after a request it keeps polling the control socket for
``busy_poll_us`` before sleeping; the stats socket, reaper and watchdog still run while
requests keep coming. And the client's spin for replies."""

import socket
import threading
import time

import numpy as np
import pytest

import helpers
from sparsekv.client import Client
from sparsekv.bench.private_daemon import PrivateDaemon
from sparsekv.daemon.config import Config, ConfigError

LAYOUT = helpers.layout(num_layers=1, row_bytes=32, top_k=4, region_stride=8, max_reqs=2, host_rows=64)


def _stats_line(path: str) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(path)
        s.sendall(b"json\n")
        return s.makefile().read()


def test_busy_polling_daemon_serves_and_keeps_its_stats_socket_alive(tmp_path):
    with PrivateDaemon(pool_bytes=64 << 20, backend="cpu", extra_args=["--busy-poll-us", "200000"],
                       log_path=str(tmp_path / "d.log")) as d:
        stop = threading.Event()
        done = []

        def traffic():
            with Client(d.run_dir, timeout_s=10, spin_us=100) as c:
                c.attach(LAYOUT, engine="b")
                t = 0
                while not stop.is_set():
                    c.step(t, [0])
                    r = c.topk(t, 0, np.array([[0, 1, 2, 3]], np.int32))
                    done.append(int(r.misses[0]))
                    t += 1

        th = threading.Thread(target=traffic)
        th.start()
        try:
            time.sleep(0.3)
            t0 = time.perf_counter()
            out = _stats_line(f"{d.run_dir}/stats.sock")  # answered although requests never stop
            took = time.perf_counter() - t0
        finally:
            stop.set()
            th.join(20)
        assert '"steps"' in out and took < 2.0
        assert len(done) > 10 and done[0] == 4 and set(done[1:]) == {0}


def test_busy_poll_setting_is_checked():
    with pytest.raises(ConfigError, match="busy_poll_us"):
        Config(busy_poll_us=-2).validate()
    assert Config().busy_poll_us == -1  # auto: 1000 us on cuda, off on cpu
