"""The prefill worker: hosts one PREFILL engine instance; computes prompts and holds their KV for the hand-off."""
