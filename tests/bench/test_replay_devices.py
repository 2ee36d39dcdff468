"""``replay --ranks N`` on the doorbell: each rank's step arrays go to that rank's GPU
(rank r on cuda:r modulo the GPUs), which its handle requires, not to the current device."""

import types

import numpy as np
import pytest

from sparsekv.bench.replay import DoorbellDriver

torch = pytest.importorskip("torch")


def test_the_doorbell_driver_puts_a_steps_arrays_on_its_ranks_device():
    driver = object.__new__(DoorbellDriver)  # (its constructor attaches to a daemon)
    driver.torch, driver.client = torch, types.SimpleNamespace(device="meta")  # a device that is not the current one
    t = driver._dev(np.arange(6, dtype=np.int32).reshape(2, 3))
    assert t.device.type == "meta" and t.dtype == torch.int32 and tuple(t.shape) == (2, 3)
