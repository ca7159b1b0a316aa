"""The token-streaming worker: hosts one DECODE or COLOCATED engine instance.

Colocated instances live here rather than in prefill_worker/ because what they serve is a token stream: they need
the Attach sessions, per-step batching and abort paths of a decode instance, and none of the hand-off holding of a
prefill instance (a colocated request never leaves its instance).
"""
