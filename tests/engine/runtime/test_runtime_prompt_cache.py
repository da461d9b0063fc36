"""The one rule of prompt caching (engine/runtime/prompt_cache.py), and the pipeline's parked
streams built on it (engine/pipeline/prompt_cache.py): which kept state a prompt starts
from, how much of it, and -- with a chunk grid -- only whole chunks computed on that grid."""

from __future__ import annotations

from engine.pipeline.prompt_cache import Parked, ParkedStreams, cut_at, hidden_count, holes_after_cut
from engine.runtime.prompt_cache import MIN_REUSE, best_reuse, common_prefix


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


def test_parking_over_capacity_frees_the_oldest():
    parked = ParkedStreams(capacity=1)
    assert parked.park(Parked("a", 1, 20, tuple(range(20)))) == []
    assert parked.park(Parked("b", 1, 20, tuple(range(20)))) == ["a"]
    assert ParkedStreams(capacity=0).park(Parked("c", 1, 20, tuple(range(20)))) == ["c"]


def test_a_cut_skips_the_holes_before_it_and_swallows_the_ones_after():
    holes = (10, 14, 30, 32)  # 4 + 2 hidden physical positions
    assert hidden_count(holes) == 6
    assert cut_at(5, holes) == 5  # before any hole
    assert cut_at(10, holes) == 10  # right at a hole: the hole goes with the cut
    assert cut_at(12, holes) == 16  # 10 visible, the hole [10, 14), 2 more
    assert cut_at(40, holes) == 46
    assert holes_after_cut(holes, 16, 50) == (10, 14, 16, 50)
    assert holes_after_cut(holes, 10, 50) == (10, 50)
    assert holes_after_cut((), 20, 20) == ()  # nothing past the cut
