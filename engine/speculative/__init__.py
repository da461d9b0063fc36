"""Speculative decoding with mask-based KV rollback (docs/speculative.md).

    config.py   SpecConfig (engine defaults) and SpecSettings (one request's)
    kv.py       VisibleMask: hidden KV positions, compaction, physical trim
    verify.py   exact greedy verification and the rejection-sampling rule
    adaptive.py K from the running acceptance rate
    drafts.py   draft sources: a small draft model (OpenVINO), prompt lookup
    session.py  one request's speculation: draft, verify, accept tokens

Engines plug it in with a narrow hook: engine/speculative/local.py
(LocalEngine) and engine/pipeline/speculative.py (the pipeline coordinator).
"""
