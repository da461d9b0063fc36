"""The one rule of prompt caching (engine/runtime/prompt_cache.py), the kept states the
engines hold it over, and the pipeline's parked streams built on it (engine/pipeline/prompt_cache.py): which kept state a prompt starts
from, how much of it, and -- with a chunk grid -- only whole chunks computed on that grid."""

from __future__ import annotations

from engine.pipeline.prompt_cache import Parked, ParkedStreams
from engine.runtime.prompt_cache import MIN_REUSE, KeptStates, best_reuse, common_prefix


def test_common_prefix_counts_leading_equal_ids():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5], [1]) == 0


def test_the_longest_shared_prefix_wins_but_never_the_whole_prompt():
    prompt = list(range(100))
    held = [list(range(40)) + [999], list(range(100)) + [7]]
    assert best_reuse(held, prompt) == (1, 99)  # the last prompt id must run for the next logits


def test_a_short_match_is_not_reused():
    prompt = list(range(100))
    assert best_reuse([list(range(MIN_REUSE - 1)) + [-1]], prompt) == (None, 0)


def test_a_grid_keeps_whole_chunks_only():
    prompt = list(range(300))
    held = [list(range(250)) + [-1]]
    assert best_reuse(held, prompt, grid=64) == (0, 192)  # 250 shared -> 3 whole chunks of 64
    assert best_reuse(held, prompt, grid=512) == (None, 0)  # not one whole chunk shared


def test_parked_streams_reuse_only_their_whole_prompt_chunks_on_a_grid():
    ids = tuple(range(200))  # a 150-id prompt's stream, answered 50 ids
    parked = ParkedStreams(capacity=2)
    parked.park(Parked("s1", seq=9, past=200, ids=ids, exact=128))  # 150 -> whole chunks of 64: 128
    follow_up = list(range(200)) + [7, 8, 9]
    stream, keep = parked.take(follow_up, grid=64)
    assert (stream.stream_id, keep) == ("s1", 128)  # the partial chunk and the answer are prefilled again
    assert len(parked) == 0
    parked.park(Parked("s2", seq=9, past=200, ids=ids, exact=128))
    assert parked.take(follow_up)[1] == 200  # without a grid everything shared is kept


def test_parked_streams_hand_over_the_longest_match_once():
    parked = ParkedStreams(capacity=2)
    parked.park(Parked("short", seq=3, past=30, ids=tuple(range(30))))
    parked.park(Parked("long", seq=9, past=200, ids=tuple(range(200))))
    stream, keep = parked.take(list(range(120)) + [7])
    assert (stream.stream_id, keep) == ("long", 120)
    assert len(parked) == 1 and parked.take([99] * 40) is None  # no shared prefix: nothing taken


def test_parking_over_capacity_frees_the_oldest():
    parked = ParkedStreams(capacity=1)
    assert parked.park(Parked("a", 1, 20, tuple(range(20)))) == []
    assert parked.park(Parked("b", 1, 20, tuple(range(20)))) == ["a"]
    assert ParkedStreams(capacity=0).park(Parked("c", 1, 20, tuple(range(20)))) == ["c"]



def test_kept_states_hand_over_the_best_match_and_drop_the_oldest_first():
    kept: KeptStates[str] = KeptStates()
    kept.keep("a", range(40))
    kept.keep("b", range(100))
    kept.keep("c", [9] * 30)
    assert kept.tokens == 170
    assert kept.take(list(range(60))) == ("b", list(range(100)), 59)  # out of the container
    assert kept.take([1, 2, 3]) is None and len(kept) == 2
    assert kept.pop(newest=True) == ("c", [9] * 30)
    kept.keep("d", [])
    assert kept.drop(1) == ["a"] and kept.drop(0) == [] and kept.drop(5) == ["d"] and len(kept) == 0
