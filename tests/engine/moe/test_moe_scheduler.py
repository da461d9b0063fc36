"""Bevy's rule for when requests done with a layer enter the next one (entering_now).

Every entry reads the layer's attention weights (the head's, past the last layer) whatever
its rows, so a wave of requests split across entries pays them again; requests wait for the
rest of their pass only while the disk is busy serving it."""

from engine.moe.scheduler import entering_now


def test_a_group_with_nobody_behind_it_enters():
    # 4 done with layer 0, 3 done with layer 2, one request waits for experts at layer 2 (done with 1)
    assert entering_now({0: 4, 2: 3}, behind=[1], disk_idle=False) == {0}


def test_a_group_waits_for_the_requests_of_its_pass_behind_it_while_the_disk_is_busy():
    assert entering_now({2: 3}, behind=[0, 1], disk_idle=False) == set()
    # a group lined up at an earlier layer is behind it too
    assert entering_now({1: 2, 2: 3}, behind=[], disk_idle=False) == {1}


def test_requests_about_to_start_their_pass_hold_every_group_back():
    assert entering_now({0: 2, 3: 5}, behind=[-1], disk_idle=False) == set()


def test_when_the_disk_would_idle_the_biggest_group_enters_at_once():
    assert entering_now({1: 2, 3: 5}, behind=[0], disk_idle=True) == {3}
    assert entering_now({1: 4, 3: 4}, behind=[0], disk_idle=True) == {3}  # a tie: the furthest


def test_groups_whose_requests_all_ended_hold_nobody_back():
    assert entering_now({0: 0, 2: 3}, behind=[], disk_idle=False) == {0, 2}


def test_nothing_lined_up_nothing_enters():
    assert entering_now({}, behind=[0, 2], disk_idle=True) == set()
