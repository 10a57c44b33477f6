"""Training Medusa-1 heads on a frozen target (Cai et al. 2024, arXiv 2401.10774, Sec. 2.2.1): self-distillation on
the target's own answers, the data that matches what the server will verify.

1. `regenerate` (engine/training/answers.py): every prompt through the chat template, answered greedily by the target itself (the in-process
   engine, plain decoding), kept in OUT/data.pt so a restart does not answer again.
2. `final_states`: the frozen target's last hidden states (after its final norm) over each prompt + answer.
3. `train`: head i on the state at position t predicts the token at t + 2 + i (the target's LM head predicts t + 1),
   over answer positions only; loss the sum over heads of cross-entropy weighted 0.8^i (Medusa's decay); ResBlocks
   zero-initialised, each head's own LM head initialised from the target's (Medusa's), or the target's LM head shared
   and frozen (`shared_lm_head`); with `draft_vocab` N, heads draft from the answers' N most frequent tokens only (the
   LM heads' rows of them: cheaper to train and to draft from; the rest are never proposed). AdamW; a checkpoint of heads, optimizer and position every `save_every` steps
   (OUT/train_state.pt), which a restart resumes from.
4. The heads in the checkpoint format engine/proposers/medusa.py loads (config.json + medusa_lm_head.safetensors),
   and OUT/training.json: the data's size, the time taken and each head's top-1 accuracy on held-out answers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.proposers.medusa import MedusaConfig, MedusaHeads
from engine.training.answers import Answers, to_draft_vocab, training_split
from engine.training.loop import run_training

DECAY = 0.8  # Medusa's per-head loss weight decay


@dataclass(frozen=True)
class TrainSettings:
    num_heads: int = 3
    num_layers: int = 1
    shared_lm_head: bool = False
    epochs: int = 2
    batch_size: int = 256  # positions per step
    lr: float = 1e-3
    held_out: float = 0.1  # fraction of the answers kept out of training, to measure accuracy on
    save_every: int = 50  # steps between resumable checkpoints
    seed: int = 0
    draft_vocab: int = 0  # heads draft from the answers' most frequent tokens only (0: the whole vocabulary)


@torch.inference_mode()
def final_states(model, sequence: list[int]) -> torch.Tensor:  # [N, H] float32
    """The frozen target's last hidden states (after its final norm) at every position of `sequence`."""
    out = model.base_model(torch.tensor([sequence], device=model.device))
    return out.last_hidden_state[0].float()


def training_examples(model, answers: Answers, indices: Sequence[int], num_heads: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:  # states [P, H], targets [P, heads] (-100: none)
    """Each answer position t's state and the tokens at t + 2 + i for every head i (-100 past the end)."""
    states, targets = [], []
    for n in tqdm(indices, desc="target hidden states", unit="answer"):
        seq, start = answers.sequences[n], answers.prompt_lens[n]
        if len(seq) - start < 2:
            continue
        hidden = final_states(model, seq)
        positions = torch.arange(start - 1, len(seq) - 2)  # the state that predicts answer token t + 1 ...
        ids = torch.tensor(seq + [-100] * (num_heads + 2))
        states.append(hidden[positions].cpu())
        targets.append(torch.stack([ids[positions + 2 + i] for i in range(num_heads)], dim=1))
    if not states:
        raise ValueError("no answers of two tokens or more to train on")
    return torch.cat(states), torch.cat(targets)


def head_logits(heads: MedusaHeads, lm_head: torch.nn.Module, states: torch.Tensor) -> torch.Tensor:
    """[P, H] -> [P, heads, V]"""
    return heads(states, lm_head)


def head_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # [P, heads, V], [P, heads]
    weights = [DECAY ** i for i in range(logits.shape[1])]
    return sum(w * F.cross_entropy(logits[:, i].float(), targets[:, i], ignore_index=-100)
               for i, w in enumerate(weights)) / sum(weights)


@torch.no_grad()
def head_accuracy(heads: MedusaHeads, lm_head, states: torch.Tensor, targets: torch.Tensor,
                  batch: int = 512) -> list[float]:
    """Each head's top-1 accuracy over the examples (positions past the end left out)."""
    right = torch.zeros(targets.shape[1])
    counted = (targets != -100).sum(0).float()
    for start in range(0, len(states), batch):
        guess = head_logits(heads, lm_head, states[start:start + batch]).argmax(-1)
        right += (guess == targets[start:start + batch]).sum(0).float()
    return (right / counted.clamp(min=1)).tolist()


def restricted_lm_head(model, vocab: tuple[int, ...] | None) -> torch.nn.Module:
    """The target's LM head, or its rows of a draft vocabulary (frozen)."""
    head = model.get_output_embeddings()
    if vocab is None:
        return head
    rows = torch.nn.Linear(head.weight.shape[1], len(vocab), bias=False)
    rows.weight = torch.nn.Parameter(head.weight.detach()[list(vocab)].clone(), requires_grad=False)
    return rows


def new_heads(model, settings: TrainSettings, vocab: tuple[int, ...] | None = None) -> MedusaHeads:
    config = model.config
    heads = MedusaHeads(MedusaConfig(settings.num_heads, settings.num_layers, config.hidden_size,
                                     model.get_output_embeddings().weight.shape[0], settings.shared_lm_head, vocab))
    if not settings.shared_lm_head:  # each head's LM head starts as the target's (Medusa's initialisation)
        with torch.no_grad():
            for head in heads.heads:
                head[-1].weight.copy_(restricted_lm_head(model, vocab).weight.float())
    return heads


def train(model, answers: Answers, out: Path, settings: TrainSettings = TrainSettings(), base_model: str | None = None,
          progress: Callable | None = None) -> dict:
    """Train heads on `answers` (resuming from OUT/train_state.pt when it exists), save them in OUT; the report."""
    began = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    held, kept, vocab = training_split(model, answers, settings.held_out, settings.seed, settings.draft_vocab)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    lm_head = restricted_lm_head(model, vocab)  # the model is loaded in float32 for training
    states, targets = training_examples(model, answers, kept, settings.num_heads)
    targets = to_draft_vocab(targets, vocab, vocab_size)
    heads = new_heads(model, settings, vocab)
    optimizer = torch.optim.AdamW([p for p in heads.parameters() if p.requires_grad], lr=settings.lr)

    def train_step(index: torch.Tensor) -> float:
        loss = head_loss(head_logits(heads, lm_head, states[index]), targets[index])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    heads.train()
    total = run_training(settings, len(states), {"heads": heads, "optimizer": optimizer}, out / "train_state.pt",
                         "training Medusa heads", train_step)
    heads.eval()
    heads.save(out, base_model)
    report = {"prompts": len(answers.sequences), "answer_tokens": answers.answer_tokens,
              "train_positions": len(states), "held_out_prompts": len(held), "steps": total,
              "settings": asdict(settings), "seconds": round(time.perf_counter() - began, 1)}
    if held:
        held_states, held_targets = training_examples(model, answers, held, settings.num_heads)
        exact = to_draft_vocab(held_targets, vocab, vocab_size)  # a token outside the draft vocabulary: a miss
        exact[(held_targets >= 0) & (exact < 0)] = vocab_size + 1
        report["held_out_accuracy"] = [round(a, 4) for a in head_accuracy(heads, lm_head, held_states, exact)]
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
