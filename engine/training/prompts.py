"""The prompt set shipped for training draft heads (`specserve train-heads`) and for start-up measurements
(`draft: self`'s choice of L): prompts.jsonl beside this module, one {"prompt": ...} or {"messages": [...]} per line,
none of them in bench/prompts.jsonl (the benchmarks measure on prompts the heads were not trained on)."""

from __future__ import annotations

import json
from pathlib import Path

SHIPPED = Path(__file__).with_name("prompts.jsonl")


def training_prompts(path: str | Path | None = None) -> list[list[dict]]:
    """Each line of a JSONL prompt file as a chat message list."""
    out = []
    for number, line in enumerate(Path(path or SHIPPED).read_text().splitlines(), 1):
        if not line.strip():
            continue
        item = json.loads(line)
        if "messages" in item:
            out.append(list(item["messages"]))
        elif "prompt" in item:
            out.append([{"role": "user", "content": item["prompt"]}])
        else:
            raise ValueError(f"{path or SHIPPED}:{number}: a line needs 'prompt' or 'messages'")
    return out


def encode_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The messages through the tokenizer's chat template (the text itself where it has none)."""
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=True)
        return list(encoded["input_ids"])
    return list(tokenizer("\n".join(m["content"] for m in messages))["input_ids"])
