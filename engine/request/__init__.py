"""What belongs to one request: sampling parameters, sequence state, stop conditions, logits processing,
structured-output grammars and prompt logprobs."""
