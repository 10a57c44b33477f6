"""The loop both head trainers run (engine/training/medusa.py, engine/training/eagle3.py): epochs of shuffled batches
through one optimizer step each, with a checkpoint a restart resumes from."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm


def run_training(settings, examples: int, parts: dict, state_file: Path, desc: str,
                 train_step: Callable[[torch.Tensor], float]) -> int:
    """`settings.epochs` epochs over `examples` examples, each epoch a seeded permutation cut into batches of
    `settings.batch_size` indices, each batch one `train_step(indices)` (it returns the batch's loss). `parts` (name
    -> anything with state_dict/load_state_dict: the heads, the optimizer, a schedule) are resumed from `state_file`
    when it was written for these settings and this many examples, and written there every `settings.save_every`
    steps and at the end. Returns the number of steps of the whole run."""
    steps_per_epoch = -(-examples // settings.batch_size)
    total = settings.epochs * steps_per_epoch
    step = 0
    if state_file.is_file():
        saved = torch.load(state_file, weights_only=False)
        if saved["settings"] == asdict(settings) and saved["examples"] == examples:
            for name, part in parts.items():
                part.load_state_dict(saved[name])
            step = saved["step"]
    gen = torch.Generator().manual_seed(settings.seed)
    permutations = [torch.randperm(examples, generator=gen) for _ in range(settings.epochs)]
    with tqdm(total=total, initial=step, desc=desc, unit="step") as bar:
        while step < total:
            epoch, offset = divmod(step, steps_per_epoch)
            loss = train_step(permutations[epoch][offset * settings.batch_size:(offset + 1) * settings.batch_size])
            step += 1
            bar.update()
            bar.set_postfix(loss=f"{loss:.3f}")
            if step % settings.save_every == 0 or step == total:
                torch.save({"settings": asdict(settings), "examples": examples, "step": step,
                            **{name: part.state_dict() for name, part in parts.items()}}, state_file)
    return total
