"""The host-side order of a device-driven step (client/step_order.py): each rule that
keeps the engine's stream and the daemon's from waiting on each other for ever, or from
releasing a layer one step early, refuses the call that breaks it before anything runs."""

import pytest

from sparsekv.client.errors import BadRequest, NotAttached
from sparsekv.client.step_order import StepOrder

GROUPS = [[0, 1, 2], [3, 4], [5]]


def run_layers(order, layers):
    for layer in layers:
        if order.check_layer(layer):
            order.rang(order.group_of[layer])
        order.ready(layer)


def test_a_whole_step_in_order_is_complete_and_the_next_may_begin():
    o = StepOrder(GROUPS)
    for _ in range(3):
        o.check_begin()
        o.began()
        assert not o.complete
        run_layers(o, range(6))
        assert o.complete and o.pending() == ([], [])


def test_swap_in_before_the_first_begin_step_is_refused():
    with pytest.raises(BadRequest, match="begin_step"):
        StepOrder(GROUPS).check_layer(0)


def test_a_layer_out_of_range_is_refused_by_number():
    o = StepOrder(GROUPS)
    o.began()
    with pytest.raises(BadRequest, match=r"layer 6 out of range \[0, 6\)"):
        o.check_layer(6)


def test_groups_out_of_order_are_refused_naming_the_group_not_yet_called():
    o = StepOrder(GROUPS)
    o.began()
    with pytest.raises(BadRequest, match="group 0 .leader layer 0. has not been called"):
        o.check_layer(3)  # group 1 before group 0: both streams would wait for ever
    run_layers(o, [0])
    with pytest.raises(BadRequest, match="group 1 .leader layer 3. has not been called"):
        o.check_layer(5)


def test_a_follower_before_its_leader_is_refused():
    o = StepOrder(GROUPS)
    o.began()
    with pytest.raises(BadRequest, match="follows layer 0 in index group 0"):
        o.check_layer(1)


def test_a_layer_twice_in_one_step_is_refused():
    o = StepOrder(GROUPS)
    o.began()
    run_layers(o, [0, 1])
    with pytest.raises(BadRequest, match="layer 1 twice in step 0"):
        o.check_layer(1)  # its ready word was consumed: a second wait would hang


def test_followers_of_earlier_groups_may_come_after_later_groups_rang():
    o = StepOrder(GROUPS)
    o.began()
    run_layers(o, [0, 3, 5, 1, 2, 4])  # every bell rung in order; layers in any order after
    assert o.complete


def test_begin_step_on_an_incomplete_step_names_what_is_missing():
    o = StepOrder(GROUPS)
    o.began()
    run_layers(o, [0, 1, 3])
    with pytest.raises(BadRequest, match=r"step 0 is not complete \(groups \[2\] not rung, layers 2, 4-5 without "
                                         r"swap_in\).*finish_step"):
        o.check_begin()
    assert o.pending() == ([2], [2, 4, 5])


def test_a_skipped_layer_blocks_the_next_step_until_the_step_is_finished():
    o = StepOrder(GROUPS)
    o.began()
    run_layers(o, [0, 1, 3, 4, 5])  # layer 2 skipped: its ready word would stay set
    with pytest.raises(BadRequest, match="layers 2 without swap_in"):
        o.check_begin()
    groups, layers = o.pending()
    for g in groups:
        o.rang(g)
    for layer in layers:
        o.ready(layer)
    o.check_begin()


def test_a_closed_order_refuses_every_call():
    o = StepOrder(GROUPS)
    o.close()
    with pytest.raises(NotAttached, match="closed"):
        o.check_begin()
    with pytest.raises(NotAttached, match="closed"):
        o.check_layer(0)
