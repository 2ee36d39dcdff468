"""``sparsekv`` commands run through the command line's ``main`` in the test's process.

Imported by test modules as ``cli_inproc`` (``tests/`` is on ``sys.path``, as for
``helpers``). Kept out of ``helpers``, which the rank processes' forkserver imports: they
need none of the command line.
"""

from __future__ import annotations

import contextlib
import io
import logging
import signal
import subprocess

from sparsekv.cli.main import main


def run(*args) -> subprocess.CompletedProcess:
    """``sparsekv ARGS`` like ``helpers.run_cli``, without a new interpreter (a third of a
    second of CPU each): for commands whose answer, not their process, is what a test
    checks. ``returncode`` is what ``main`` returned, or argparse's exit status; log
    records of WARNING and above go to its stderr, as the command's would (it sets up no
    logging). The SIGTERM handler ``main`` installs is put back."""
    out, err = io.StringIO(), io.StringIO()
    handler = signal.getsignal(signal.SIGTERM)
    logs = logging.StreamHandler(err)
    logs.setLevel(logging.WARNING)
    logging.getLogger().addHandler(logs)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:
                code = e.code or 0
    finally:
        logging.getLogger().removeHandler(logs)
        signal.signal(signal.SIGTERM, handler)
    return subprocess.CompletedProcess(["sparsekv", *map(str, args)], code, out.getvalue(), err.getvalue())
