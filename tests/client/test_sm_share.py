"""client.sm_share: the SMs a step's matmuls leave to the swap-in beside them."""

from types import SimpleNamespace

import pytest

from sparsekv.client.sm_share import check_sms, leave_sms

torch = pytest.importorskip("torch")
if not hasattr(torch._C, "_set_sm_carveout_experimental"):
    pytest.skip("this torch has no cuBLAS SM carveout", allow_module_level=True)


@pytest.fixture
def gpu_of_132(monkeypatch):
    """A CUDA device of 132 SMs as torch reports it (the carveout itself is a CPU-side setting)."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: SimpleNamespace(multi_processor_count=132))
    before = torch._C._get_sm_carveout_experimental()
    yield
    torch._C._set_sm_carveout_experimental(before)


def test_sets_the_carveout_inside_and_restores_it(gpu_of_132):
    torch._C._set_sm_carveout_experimental(None)
    with leave_sms(8):
        assert torch._C._get_sm_carveout_experimental() == 8
        with leave_sms(0):  # none inside
            assert torch._C._get_sm_carveout_experimental() is None
        assert torch._C._get_sm_carveout_experimental() == 8
    assert torch._C._get_sm_carveout_experimental() is None


def test_restores_an_earlier_setting_after_an_exception(gpu_of_132):
    torch._C._set_sm_carveout_experimental(4)
    with pytest.raises(KeyError):
        with leave_sms(16):
            raise KeyError("in the step")
    assert torch._C._get_sm_carveout_experimental() == 4


@pytest.mark.parametrize("bad", [-1, 132, 500, 2.0, "8", True, None])
def test_refuses_what_is_not_a_count_of_this_gpus_sms(gpu_of_132, bad):
    torch._C._set_sm_carveout_experimental(None)
    with pytest.raises(ValueError, match="SMs to leave"):
        with leave_sms(bad):
            pass
    assert torch._C._get_sm_carveout_experimental() is None  # nothing set


def test_check_sms_bounds():
    assert check_sms(0, 78) == 0 and check_sms(77, 78) == 77
    with pytest.raises(ValueError, match=r"\[0, 78\)"):
        check_sms(78, 78)


def test_a_torch_without_the_carveout_is_named(monkeypatch):
    monkeypatch.delattr(torch._C, "_set_sm_carveout_experimental")
    with pytest.raises(RuntimeError, match="no cuBLAS SM carveout"):
        with leave_sms(8):
            pass
