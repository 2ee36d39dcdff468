"""Test options: GPU tests are marked ``cuda``; ``--require-cuda`` makes their skip a failure."""

import functools

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--require-cuda",
        action="store_true",
        help="fail (instead of skip) tests marked cuda when no usable GPU is found",
    )


@functools.cache
def cuda_unavailable_reason():
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as e:  # noqa: BLE001 - any import/driver failure means no GPU here
        return f"CUDA unavailable: {type(e).__name__}: {e}"
    return None


def pytest_runtest_setup(item):
    if "cuda" not in item.keywords:
        return
    reason = cuda_unavailable_reason()
    if reason is None:
        return
    if item.config.getoption("--require-cuda"):
        pytest.fail(f"--require-cuda: {reason}", pytrace=False)
    pytest.skip(reason)
