"""User prompts written by the target itself, for training draft heads on more than the shipped set.

Magpie (Xu et al. 2024, "Magpie: Alignment Data Synthesis from Scratch by Prompting Aligned LLMs with Nothing",
arXiv 2406.08464): an instruction-tuned model given its chat template only up to where a user's message begins
writes a user's message, drawn from what its own chat training taught it users ask. Heads trained on the target's
answers to such prompts see the requests the model expects rather than a few hand-written templates; and no
dataset has to be downloaded (Medusa and EAGLE train on ShareGPT and UltraChat, which this machine cannot reach).

`specserve make-prompts` writes them as a prompt file `specserve train-heads --prompts` reads (engine/cli.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

_MARK = "\u2063PROMPT\u2063"  # a user message no template changes, cut out of the rendered conversation
MIN_CHARS = 12  # shorter messages are greetings or fragments, no request to answer


def pre_query_ids(tokenizer) -> list[int]:
    """The chat template's tokens before a user's message (its system prompt, where it adds one, and the user turn's
    header). ValueError where the tokenizer has no chat template: a base model has no user turn to write."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the target's tokenizer has no chat template: prompts are sampled from its user turn")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
    if _MARK not in text:
        raise ValueError("the chat template does not render the user's message as given")
    return list(tokenizer(text[: text.index(_MARK)], add_special_tokens=False)["input_ids"])


def sample_prompts(engine, count: int, seed: int = 0, max_tokens: int = 96, temperature: float = 1.0,
                   top_p: float = 1.0, batch: int = 16, exclude: set[str] | None = None) -> list[str]:
    """`count` distinct user messages the target writes after `pre_query_ids` (each row seeded: seed, seed + 1,
    ...), keeping those that end their turn within `max_tokens` and have at least MIN_CHARS characters; messages
    in `exclude` (compared case-folded, spaces collapsed) are dropped, so benchmark prompts stay unseen. Stops after
    8 x `count` attempts with what it has."""
    from engine.request.sampling import SamplingParams

    prefix = pre_query_ids(engine.tokenizer)
    seen = {_key(text) for text in exclude or ()}
    kept: list[str] = []
    batch = min(batch, engine.target.capacity or batch)
    with tqdm(total=count, desc="sampling prompts", unit="prompt") as bar:
        for start in range(seed, seed + 8 * count, batch):
            if len(kept) >= count:
                break
            params = [SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=start + i)
                      for i in range(batch)]
            for done in engine.generate([prefix] * batch, params, k=0):
                text = done.text.strip()
                if done.finish_reason != "stop" or len(text) < MIN_CHARS or _key(text) in seen:
                    continue
                seen.add(_key(text))
                kept.append(text)
                bar.update()
    return kept[:count]


def write_prompts(prompts: list[str], path: str | Path) -> None:
    """One {"prompt": ...} per line (engine/training/prompts.training_prompts reads it)."""
    Path(path).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))


def _key(text: str) -> str:
    return " ".join(text.casefold().split())
