"""Bevy's rules: when requests done with a layer enter the next one (entering_now), and in
how many waves it moves its requests (wave_count).

Every entry reads the layer's attention weights (the head's, past the last layer) whatever
its rows, so a wave of requests split across entries pays them again; requests wait for the
rest of their wave only while the disk is busy serving it. Two waves fill each other's
moments without reads, when the cache holds what both need."""

from engine.moe.scheduler import entering_now, next_pass_guesses, two_waves, wave_count


def w0(*layers: int) -> list[tuple[int, int]]:
    """Requests of wave 0 at these layers."""
    return [(0, m) for m in layers]


def test_a_group_with_nobody_behind_it_enters():
    # 4 done with layer 0, 3 done with layer 2, one request waits for experts at layer 2 (done with 1)
    assert entering_now({(0, 0): 4, (0, 2): 3}, behind=w0(1), disk_idle=False) == {(0, 0)}


def test_a_group_waits_for_the_requests_of_its_wave_behind_it_while_the_disk_is_busy():
    assert entering_now({(0, 2): 3}, behind=w0(0, 1), disk_idle=False) == set()
    # a group lined up at an earlier layer is behind it too
    assert entering_now({(0, 1): 2, (0, 2): 3}, behind=[], disk_idle=False) == {(0, 1)}


def test_requests_of_another_wave_hold_nobody_back():
    # wave 1 is a layer behind wave 0: wave 0's group goes on; wave 1's waits for its own
    assert entering_now({(0, 2): 8, (1, 1): 3}, behind=[(1, 0)], disk_idle=False) == {(0, 2)}


def test_requests_about_to_start_their_pass_hold_every_group_of_their_wave_back():
    assert entering_now({(0, 0): 2, (0, 3): 5}, behind=w0(-1), disk_idle=False) == set()
    assert entering_now({(0, 0): 2, (0, 3): 5}, behind=[(1, -1)], disk_idle=False) == {(0, 0)}


def test_when_the_disk_would_idle_the_biggest_group_enters_at_once():
    assert entering_now({(0, 1): 2, (0, 3): 5}, behind=w0(0), disk_idle=True) == {(0, 3)}
    assert entering_now({(0, 1): 4, (0, 3): 4}, behind=w0(0), disk_idle=True) == {(0, 3)}  # a tie: the furthest
    assert entering_now({(0, 1): 2, (1, 1): 5}, behind=[(0, 0), (1, 0)], disk_idle=True) == {(1, 1)}


def test_groups_whose_requests_all_ended_hold_nobody_back():
    assert entering_now({(0, 0): 0, (0, 2): 3}, behind=[], disk_idle=False) == {(0, 0), (0, 2)}


def test_nothing_lined_up_nothing_enters():
    assert entering_now({}, behind=w0(0, 2), disk_idle=True) == set()


def test_one_request_is_one_wave():
    assert wave_count(1, experts=128, top_k=8, cache_slots=10_000) == 1


def test_two_waves_when_the_cache_holds_two_layers_of_a_wave_s_experts():
    # Qwen3-30B-A3B's routing: 16 requests pick about 82 of 128 experts a layer
    assert wave_count(16, experts=128, top_k=8, cache_slots=170) == 2
    assert wave_count(16, experts=128, top_k=8, cache_slots=150) == 1


def test_a_few_wide_experts_are_one_wave():
    # Mixtral's 8 experts, top-2: 16 requests need all 8 a layer; a cache of 5 cannot hold two layers
    assert wave_count(16, experts=8, top_k=2, cache_slots=5) == 1
    assert wave_count(2, experts=8, top_k=2, cache_slots=5) == 1


def test_one_wave_splits_when_its_stall_outweighs_the_split_s_cost():
    # per window: wall 60 ms, the disk busy 36 ms, compute 40 ms of which head + attention 20 ms;
    # 20 ms with neither busy enough, against 0.3 x 20 ms a second wave would add
    assert two_waves(wall_s=0.060, compute_s=0.040, disk_s=0.036, split_s=0.020, waves=1)
    # compute-bound: the compute busy nearly all the wall time, nothing to fill
    assert not two_waves(wall_s=0.065, compute_s=0.063, disk_s=0.052, split_s=0.010, waves=1)
    # the disk busy all the time: a second wave cannot read more
    assert not two_waves(wall_s=0.060, compute_s=0.030, disk_s=0.059, split_s=0.010, waves=1)
    # a stall smaller than the split's cost
    assert not two_waves(wall_s=0.050, compute_s=0.045, disk_s=0.040, split_s=0.020, waves=1)


def test_two_waves_stay_until_the_compute_is_busy_nearly_all_the_time():
    assert two_waves(wall_s=0.050, compute_s=0.045, disk_s=0.040, split_s=0.020, waves=2)
    assert not two_waves(wall_s=0.050, compute_s=0.048, disk_s=0.040, split_s=0.020, waves=2)


def test_before_a_head_bevy_guess_reads_nothing_for_a_request_or_two():
    # one request picking 8 of 128 experts needs an absent one with chance 6 %: a read would be wasted
    assert next_pass_guesses({5: 9}, list(range(100)), 128, 8, rows=1) == []
    assert next_pass_guesses({}, list(range(8)), 8, 2, rows=1) == []  # 2 of 8: 25 %


def test_before_a_head_bevy_guess_reads_the_likely_misses_most_picked_first():
    absent = list(range(10, 60))
    picks = {40: 7, 12: 3, 55: 3, 3: 99}  # expert 3 is resident: never read
    got = next_pass_guesses(picks, absent, 128, 8, rows=16)
    used = 1 - (1 - 8 / 128) ** 16  # 0.64: the share of the absent ones the requests will pick
    assert len(got) == round(used * len(absent)) == 32
    assert got[:3] == [40, 12, 55] and set(got) <= set(absent) and len(set(got)) == len(got)
