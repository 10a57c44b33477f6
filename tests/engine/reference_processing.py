"""A dense, one-position reference of vLLM's request-level logits processing (its v1 Sampler's order: min_tokens,
logit_bias, then the repetition, frequency and presence penalties over the whole vocabulary), written from the
definitions and independent of engine/request/builtin_processors.py, and plain decoding with it over a Hugging Face model."""

from __future__ import annotations

import torch

from engine.request.sampling import SamplingParams


def reference_logits(
    logits: torch.Tensor,  # [V] the model's logits after `prompt + output`
    prompt: list[int],
    output: list[int],
    params: SamplingParams,
    eos_ids: tuple[int, ...] = (),
) -> torch.Tensor:  # [V] float32
    out = logits.float().clone()
    vocab = out.shape[-1]
    if len(output) < params.min_tokens:
        for t in set(eos_ids) | set(params.stop_token_ids):
            out[t] = float("-inf")
    for t, b in params.logit_bias:
        out[t] += b
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float()
    seen = counts > 0
    seen[torch.tensor(prompt, dtype=torch.long)] = True
    r = params.repetition_penalty
    out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    return out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()


def reference_greedy(model, prompt: list[int], params: SamplingParams, eos_ids: tuple[int, ...] = ()) -> list[int]:
    """Plain greedy decoding with the reference processing, one full forward per token (no cache)."""
    output: list[int] = []
    with torch.no_grad():
        for _ in range(params.max_tokens):
            logits = model(torch.tensor([prompt + output])).logits[0, -1]
            output.append(int(reference_logits(logits, prompt, output, params, eos_ids).argmax()))
    return output
