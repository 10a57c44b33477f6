"""The data both head trainers read (engine/training/medusa.py, engine/training/eagle3.py): the target's own greedy
answers to the prompts, regenerated as served and kept on disk; the held-out split; the draft vocabulary."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm


@dataclass
class Answers:
    sequences: list[list[int]]  # prompt + the target's answer, token ids
    prompt_lens: list[int]

    @property
    def answer_tokens(self) -> int:
        return sum(len(s) - p for s, p in zip(self.sequences, self.prompt_lens))


def regenerate(engine, prompts: Sequence[list[int]], max_tokens: int, path: Path, batch: int = 16) -> Answers:
    """The target's greedy answers to `prompts` (token ids), from `path` when an earlier run wrote them."""
    if path.is_file():
        data = torch.load(path, weights_only=True)
        if data["prompts"] == [list(p) for p in prompts] and data["max_tokens"] == max_tokens:
            return Answers(data["sequences"], data["prompt_lens"])
    from engine.request.sampling import SamplingParams

    batch = min(batch, engine.target.capacity or batch)  # never more sequences than the KV cache holds
    sequences = []
    with tqdm(total=len(prompts), desc="regenerating answers", unit="prompt") as bar:
        for start in range(0, len(prompts), batch):
            chunk = [list(p) for p in prompts[start:start + batch]]
            for prompt, done in zip(chunk, engine.generate(chunk, SamplingParams(max_tokens=max_tokens), k=0)):
                sequences.append(prompt + done.token_ids)
            bar.update(len(chunk))
    answers = Answers(sequences, [len(p) for p in prompts])
    torch.save({"prompts": [list(p) for p in prompts], "max_tokens": max_tokens, "sequences": sequences,
                "prompt_lens": answers.prompt_lens}, path)
    return answers


def split_answers(count: int, held_out: float, seed: int) -> tuple[list[int], list[int]]:
    """(held-out, training) indices of `count` answers: a seeded shuffle, `held_out` of them kept out (at least one
    where there are two or more)."""
    order = list(range(count))
    random.Random(seed).shuffle(order)
    cut = max(1, int(count * held_out)) if count > 1 else 0
    return order[:cut], order[cut:]


def training_split(model, answers: Answers, held_out: float, seed: int, draft_vocab: int
                   ) -> tuple[list[int], list[int], tuple[int, ...] | None]:
    """The target frozen (`freeze`), the answers split (held-out, training indices), and the draft vocabulary of the
    training answers' `draft_vocab` most frequent tokens (None: 0, the whole vocabulary)."""
    freeze(model)
    held, kept = split_answers(len(answers.sequences), held_out, seed)
    return held, kept, draft_vocabulary(answers, kept, draft_vocab) if draft_vocab else None


def freeze(model) -> None:
    """The target as the trainers read it: eval mode, no gradients."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)


def draft_vocabulary(answers: Answers, indices: Sequence[int], size: int) -> tuple[int, ...]:
    """The `size` most frequent answer tokens of the given answers, ascending by id."""
    counts: dict[int, int] = {}
    for n in indices:
        for token in answers.sequences[n][answers.prompt_lens[n]:]:
            counts[token] = counts.get(token, 0) + 1
    return tuple(sorted(sorted(counts, key=lambda t: -counts[t])[:size]))


def to_draft_vocab(targets: torch.Tensor, vocab: tuple[int, ...] | None, size: int) -> torch.Tensor:
    """Target token ids -> indices in the draft vocabulary (-100: outside it, or none)."""
    if vocab is None:
        return targets
    index = torch.full((size + 1,), -100, dtype=torch.long)
    index[list(vocab)] = torch.arange(len(vocab))
    return index[torch.where(targets >= 0, targets, size)]
