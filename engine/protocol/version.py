"""The wire protocol version.

Compatibility rule: PROTOCOL_VERSION is a major version. Every envelope carries
it, and a peer accepts only its own number; any other is rejected with a clear
ProtocolError (code "version") naming both numbers, never guessed at. Any change
that an older peer could misread (a field added, removed, renamed or retyped, a
rule tightened) bumps it, because decoding is strict about the field set.
"""

# 2: SamplingParams.ignore_eos; 3: LoadRequest context_length/streams;
# 4: ErrorReply.refusal (a Refusal: reason, need_bytes, limit_bytes) with the new code "refused",
#    which agents now answer where they said "overloaded" with the reason in the text
# 5: SamplingParams.logprobs and TokenEvent.logprobs (TokenLogprob); the "tool" role,
#    ChatMessage.tool_calls / tool_call_id (ToolCall); GenerateRequest tools (ToolSpec),
#    tool_choice, forced_tool, json_schema; Usage.cached_tokens (prompt caching)
# 6: TokenEvent.error_code (EVENT_ERROR_CODES): an error's category travels as a code, not in its words
# 7: LoadRequest.kv_precision (the fleet's exact prompt cache starts its workers with a 16-bit KV cache)
PROTOCOL_VERSION: int = 7
