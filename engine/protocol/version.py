"""The wire protocol version.

Compatibility rule: PROTOCOL_VERSION is a major version. Every envelope carries
it, and a peer accepts only its own number; any other is rejected with a clear
ProtocolError (code "version") naming both numbers, never guessed at. Any change
that an older peer could misread (a field added, removed, renamed or retyped, a
rule tightened) bumps it, because decoding is strict about the field set.
"""

PROTOCOL_VERSION: int = 3  # 2: SamplingParams.ignore_eos; 3: LoadRequest context_length/streams
