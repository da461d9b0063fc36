"""The pieces: VisibleMask, prompt lookup, adaptive K, the wire fields, the request field."""

from __future__ import annotations

import msgpack
import pytest

from engine.protocol import ProtocolError, decode, decode_frames, encode, encode_frames
from engine.protocol.messages import GenerateRequest, SpeculativeParams
from engine.protocol.pipeline import StageResult, StageStep
from engine.speculative.adaptive import AdaptiveK, expected_tokens
from engine.speculative.config import SpecConfig
from engine.speculative.drafts import lookup
from engine.runtime.kv_state import VisibleMask


def test_visible_mask_hides_and_compacts():
    m = VisibleMask(capacity=4)
    m.commit(6)
    assert m.feed(2).tolist() == [[1] * 8] and m.positions(2).tolist() == [[6, 7]]
    m.hide_tail(2)  # two rejected drafts
    assert (m.length, m.hidden, m.visible) == (6, 2, 4)
    assert m.feed(1).tolist() == [[1, 1, 1, 1, 0, 0, 1]] and m.positions(1).tolist() == [[4]]
    m.commit(1)
    m.hide(1, 3)
    m.hide(2, 4)  # overlapping: counted once
    assert m.hidden == 5 and m.visible == 2 and m.keep_index().tolist() == [0, 6]
    m.compacted()
    assert (m.length, m.hidden) == (2, 0) and m.feed(0).tolist() == [[1, 1]]
    with pytest.raises(ValueError):
        m.hide(1, 3)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    ctx = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3]
    assert lookup(ctx, 2) == [4, 7]  # [2, 3] last seen before 4, 7
    assert lookup(ctx, 5, max_ngram=3) == [4, 7, 8, 2, 3]
    assert lookup([1, 2, 3], 4) == []  # no earlier match
    assert lookup([5, 5], 3) == [5]
    assert lookup(ctx, 0) == []


def test_adaptive_k_follows_the_acceptance_rate():
    high, low = AdaptiveK(4, 8), AdaptiveK(4, 8)
    for _ in range(20):
        high.update(high.k, high.k, draft_ms=0.1, step_ms=10.0)  # everything accepted
        low.update(low.k, 0, draft_ms=0.1, step_ms=10.0)  # nothing accepted
    assert high.k == 8 and low.k == 1
    assert high.acceptance > 0.9 and low.acceptance < 0.1
    fixed = AdaptiveK(3, 8, adaptive=False)
    fixed.update(3, 3)
    assert fixed.k == 3
    assert expected_tokens(0.7, 4) == pytest.approx((1 - 0.7 ** 5) / 0.3)
    # an expensive draft keeps K short even at a good acceptance rate
    costly = AdaptiveK(4, 8)
    for _ in range(20):
        costly.update(costly.k, max(0, costly.k - 1), draft_ms=5.0 * costly.k, step_ms=10.0)
    assert costly.k <= 3


def test_stage_step_speculative_fields_round_trip_and_validate():
    s = StageStep("s1", 3, 10, False, True, True, position=6, hide=(3, 5, 8, 10), compact=True, want_all=True)
    got, _ = decode_frames(encode_frames(s, []))
    assert got == s and got.logical == 6
    assert StageStep("s1", 0, 4, False, True, False).logical == 4  # the old form: position = past
    bad = [dict(hide=(5, 3)), dict(hide=(1, 2, 2, 11)), dict(hide=(1,)), dict(position=9, hide=(0, 2)),
           dict(position=-1)]
    for kw in bad:
        with pytest.raises(ProtocolError):
            StageStep("s1", 3, 10, False, True, False, **kw)
    for field, value in (("hide", [True, 2]), ("compact", 1)):  # wrong types: the wire's to refuse
        env = msgpack.unpackb(encode(StageStep("s1", 3, 10, False, True, False)))
        env["b"][field] = value
        with pytest.raises(ProtocolError):
            decode(msgpack.packb(env))
    with pytest.raises(ProtocolError):
        StageStep("s1", 0, 0, True, True, False, compact=True)
    with pytest.raises(ProtocolError):
        StageStep("s1", 0, 0, False, False, False, want_all=True)
    r = StageResult("s1", 3, 7, (1.0,), tokens=(4, 5, 7))
    assert decode_frames(encode_frames(r, []))[0] == r
    with pytest.raises(ProtocolError):
        StageResult("s1", 3, 8, (1.0,), tokens=(4, 5, 7))


def test_request_field_validates_and_resolves():
    r = GenerateRequest("a", prompt="x", speculative=SpeculativeParams("lookup", 4))
    assert decode(encode(r)) == r
    for kw in (dict(mode="fast"), dict(mode="draft", k=0), dict(mode="draft", k=17)):
        with pytest.raises(ProtocolError):
            SpeculativeParams(**kw)
    for field, value in (("k", True), ("adaptive", "yes")):  # wrong types: the wire's to refuse
        env = msgpack.unpackb(encode(r))
        env["b"]["speculative"][field] = value
        with pytest.raises(ProtocolError):
            decode(msgpack.packb(env))
    cfg = SpecConfig(mode="draft", k=3)
    assert cfg.resolve(None).mode == "draft" and cfg.resolve(None).k == 3
    own = cfg.resolve(SpeculativeParams("lookup", 12, adaptive=False))
    assert (own.mode, own.k, own.k_max, own.adaptive) == ("lookup", 12, 12, False)
    assert not cfg.resolve(SpeculativeParams("off")).on


def test_api_request_extension():
    from engine.serve.errors import ApiError
    from engine.serve.request_mapping import build_request
    from engine.serve.request_models import ChatCompletionRequest

    body = ChatCompletionRequest.model_validate({"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                                 "speculative": {"mode": "lookup", "k": 4}})
    assert build_request("r", body).speculative == SpeculativeParams("lookup", 4)
    body = ChatCompletionRequest.model_validate({"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                                 "speculative": "draft"})
    assert build_request("r", body).speculative == SpeculativeParams("draft")
    body = ChatCompletionRequest.model_validate({"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                                 "speculative": {"mode": "lookup", "k": 99}})
    with pytest.raises(ApiError) as e:
        build_request("r", body)
    assert e.value.param == "speculative" if hasattr(e.value, "param") else True
    with pytest.raises(Exception):
        ChatCompletionRequest.model_validate({"model": "demo", "messages": [{"role": "user", "content": "hi"}],
                                              "speculative": {"mode": "turbo"}})
