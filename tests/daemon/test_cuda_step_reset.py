"""A STEP message's ``reset`` on the cuda backend (``CudaRankState.begin_step``) is checked
on the host before it is written into the step block's int32 words, as on the cpu
backend: int64 2**32 and -2**32 were cast to 0 (no reset), NaN and 2.0**40 to INT_MIN (a
reset). Runs without a GPU: the check comes before anything of the rank's transport. So
does the state rows' (a STEP message is refused whole in its reply, as on cpu)."""

from types import SimpleNamespace

import numpy as np
import pytest

from sparsekv.daemon.cuda.rank import CudaRankState
from sparsekv.daemon.residency.base import ResidencyError


class Fed(Exception):
    """The check passed: the step went on to the rank's transport."""


def rank() -> CudaRankState:
    r = CudaRankState.__new__(CudaRankState)  # no GPU: only what begin_step reaches before the transport
    r.residency = SimpleNamespace(layout=SimpleNamespace(max_reqs=4, max_batch=4, top_k=4, num_groups=2))

    def fed():
        raise Fed

    r._fed = fed
    return r


@pytest.mark.parametrize("reset", [np.array([2**32, 0]), np.array([-2**32, 1]), np.array([0.5, 0.0]),
                                   np.array([np.nan, 0.0]), np.array([2.0**40, 1.0]), np.array([2, 0], np.uint8)])
def test_a_reset_that_a_cast_would_change_is_refused(reset):
    with pytest.raises(ResidencyError, match="reset must be bool"):
        rank().begin_step(0, np.array([0, 1], np.int32), reset=reset)


def test_a_reset_of_another_length_is_refused_and_good_ones_go_on():
    with pytest.raises(ResidencyError, match=r"reset must be \[batch\]"):
        rank().begin_step(0, np.array([0, 1], np.int32), reset=np.array([True]))
    for reset in (None, np.array([True, False]), np.array([1, 0], np.int64)):
        with pytest.raises(Fed):
            rank().begin_step(0, np.array([0, 1], np.int32), reset=reset)


def test_a_state_row_out_of_range_in_a_step_message_is_refused_before_the_transport():
    for rows in (np.array([0, 4], np.int32), np.array([-2], np.int32)):
        with pytest.raises(ResidencyError, match="BAD_STATE_ROW|state row"):
            rank().begin_step(0, rows)
    with pytest.raises(Fed):
        rank().begin_step(0, np.array([-1, 3], np.int32))


@pytest.mark.parametrize("then", [(7, np.zeros((2, 2), np.int32)),  # group out of range
                                  (0, np.zeros((3, 2), np.int32)),  # another batch
                                  (0, np.zeros((2, 9), np.int32)),  # k > top_k
                                  (0, np.zeros(2, np.int32))])      # not [batch, k]
def test_a_step_riding_on_a_topk_whose_shape_is_refused_is_not_fed(then):
    """All or nothing, as on cpu: the TOPK a STEP rides on is refused before the STEP goes
    to the transport (found by a review: its group and shape were checked only after)."""
    with pytest.raises(ResidencyError):
        rank().begin_step(0, np.array([0, 1], np.int32), reset=np.array([True, False]), then=then)
    with pytest.raises(Fed):
        rank().begin_step(0, np.array([0, 1], np.int32), then=(1, np.zeros((2, 4), np.int32)))
