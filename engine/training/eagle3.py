"""Training an EAGLE-3 head on a frozen target (Li et al. 2025, arXiv 2503.01840): `specserve train-heads --method
eagle3`, our own loop on plain torch (the speculators and SpecForge trainers want a GPU, datasets of saved hidden
states and their own pinned transformers; the model is the same: engine/proposers/eagle3_head.py, tested equal to
speculators' Eagle3DraftModel).

1. The target's greedy answers to the prompts, as served (engine/training/answers.regenerate, kept in OUT/data.pt).
2. The frozen target's states entering the head's three layers at every position of each prompt + answer
   (`aux_states`, float32, in memory: 3 x hidden_size floats a token), and with `labels: distribution` its final
   state (bf16: hidden_size a token).
3. Training-time test (Sec. 3.3): `ttt_steps` unrolled steps over whole sequences, step j on the head's own step
   j - 1 states, predicting the token 2 + j places after each position, over answer positions only, steps weighted
   `step_decay ** j`. `labels`: "tokens" (the default): cross-entropy against the target's greedy answer tokens;
   "distribution" (EAGLE-3's own loss, as its code and SpecForge compute it): against the target's next-token
   distribution there, restricted to the draft vocabulary (the frozen LM head's product with the target's final
   state, kept per position). On the embedded 135M the two heads agreed with the target equally often and the
   distribution's steps took longer (bench/RESULTS.md, "EAGLE-3's loss against the target's distribution"). The LM
   head is the target's rows of the draft vocabulary (the answers' most frequent tokens; `d2t` maps them back),
   frozen, as speculators trains; the target's embeddings are read, not trained or saved. AdamW;
   OUT/train_state.pt every `save_every` steps, which a restart resumes from.
4. The head in speculators' format (engine/proposers/eagle3_checkpoint.save_speculators: `vllm serve OUT` reads it
   too), and OUT/training.json: data size, time, and on held-out answers each step's top-1 accuracy and the mean
   accepted length of a K-token greedy chain (1 + the expected run of correct drafts: with every earlier draft right,
   the teacher-forced inputs are the chain's own).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaConfig

from engine.proposers.eagle3_checkpoint import save_speculators
from engine.proposers.eagle3_head import Eagle3Config, Eagle3Head, default_aux_layers
from engine.training.answers import Answers, to_draft_vocab, training_split
from engine.training.loop import run_training

LABELS = ("distribution", "tokens")


@dataclass(frozen=True)
class Eagle3Settings:
    ttt_steps: int = 3
    step_decay: float = 0.8
    draft_vocab: int = 8192  # the answers' most frequent tokens (0: the whole vocabulary)
    epochs: int = 4
    batch_size: int = 4  # sequences per step
    lr: float = 1e-3
    held_out: float = 0.1
    save_every: int = 50
    seed: int = 0
    max_len: int = 512  # positions of a sequence trained on (its first)
    labels: str = "tokens"  # or "distribution": the loss's labels (module docstring, step 3)

    def __post_init__(self):
        if self.labels not in LABELS:
            raise ValueError(f"labels: {self.labels!r} is not one of {LABELS}")


@torch.inference_mode()
def aux_states(model, sequence: list[int], layers: tuple[int, ...], final: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The frozen target's states entering `layers` at every position (transformers' hidden_states[i]) [N,
    len(layers) * H] fp32, and with `final` its final (normed) states [N, H] bf16, whose LM-head product is its
    distribution (else None)."""
    out = model.base_model(torch.tensor([sequence], device=model.device), output_hidden_states=True)  # no LM head
    return (torch.cat([out.hidden_states[i][0] for i in layers], dim=-1).float().cpu(),
            out.last_hidden_state[0].to(torch.bfloat16).cpu() if final else None)


def new_head(model, vocab: tuple[int, ...] | None) -> Eagle3Head:
    """A head of the target's shape (one Llama layer of its width, heads and rope), its LM head the target's rows of
    the draft vocabulary."""
    c = model.config
    layer = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                        num_hidden_layers=1, num_attention_heads=c.num_attention_heads,
                        num_key_value_heads=c.num_key_value_heads, rms_norm_eps=c.rms_norm_eps,
                        max_position_embeddings=c.max_position_embeddings,
                        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                        rope_parameters=getattr(c, "rope_parameters", None))
    size = c.vocab_size if vocab is None else len(vocab)
    head = Eagle3Head(Eagle3Config(layer, size, default_aux_layers(c.num_hidden_layers), c.hidden_size))
    rows = model.get_output_embeddings().weight.detach()
    with torch.no_grad():
        head.lm_head.weight.copy_(rows if vocab is None else rows[list(vocab)])
        if vocab is not None:
            head.set_draft_vocab(torch.tensor(vocab))
    head.lm_head.weight.requires_grad_(False)
    return head


@dataclass(frozen=True)
class TrainingSequence:
    """One answer as training reads it: the target's states at its positions and its tokens."""

    aux: torch.Tensor  # [N, A] the target's captured layers' states (aux_states)
    tokens: list[int]  # N token ids: the prompt, then the target's answer
    prompt_len: int  # labels start here
    finals: torch.Tensor | None = None  # [N, H] bf16 the target's final states (labels: distribution)


@dataclass
class Batch:
    aux: torch.Tensor  # [B, T, A] the head's inputs at positions 0..T-1
    tokens: torch.Tensor  # [B, T + steps + 1] positions 0..T+steps (zeros past each sequence's end)
    labels: torch.Tensor  # [B, T + steps + 1] in the draft vocabulary (-100 on prompts, padding, outside it)
    finals: torch.Tensor | None  # [B, T + steps + 1, H] the target's final states (labels: distribution)


def step_losses(head: Eagle3Head, embed, batch: Batch, steps: int
                ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Per TTT step j, (logits [B, T, V'], labels [B, T], the target's logits there [B, T, V'] or None): step j at
    position i predicts the token at i + 2 + j, which the target's final state at i + 1 + j scores."""
    t = batch.aux.shape[1]
    with torch.no_grad():
        embeds = embed(batch.tokens[:, 1:]).float()
    logits = head(batch.aux, embeds, steps)
    scored = None
    if batch.finals is not None:  # the target's logits at positions 1 .. T + steps - 1, once for every step's window
        with torch.no_grad():
            scored = head.lm_head(batch.finals[:, 1:t + steps].float())
    return [(logits[j], batch.labels[:, 2 + j: 2 + j + t], None if scored is None else scored[:, j: j + t])
            for j in range(steps)]


def batch_of(data: list[TrainingSequence], steps: int, vocab, vocab_size: int) -> Batch:
    """Sequences padded to the longest; final states only where every sequence has them."""
    t = max(len(item.aux) for item in data)
    aux = torch.zeros(len(data), t, data[0].aux.shape[1])
    tokens = torch.zeros(len(data), t + steps + 1, dtype=torch.long)
    labels = torch.full((len(data), t + steps + 1), -100, dtype=torch.long)
    with_finals = all(item.finals is not None for item in data)
    finals = torch.zeros(len(data), t + steps + 1, data[0].finals.shape[1], dtype=torch.bfloat16) \
        if with_finals else None
    for b, item in enumerate(data):
        n = len(item.aux)
        aux[b, :n] = item.aux
        tokens[b, :n] = torch.tensor(item.tokens[:n])
        labels[b, item.prompt_len:n] = to_draft_vocab(torch.tensor(item.tokens[item.prompt_len:n]), vocab, vocab_size)
        if finals is not None:
            finals[b, :n] = item.finals
    return Batch(aux, tokens, labels, finals)


def step_loss(logits: torch.Tensor, labels: torch.Tensor, scored: torch.Tensor | None) -> torch.Tensor:
    """Mean cross-entropy over the labelled positions: against the target's distribution where `scored` holds its
    logits, else against the label tokens."""
    kept = labels != -100
    if not kept.any():
        return logits.sum() * 0.0
    if scored is None:
        return F.cross_entropy(logits[kept], labels[kept])
    return -(F.softmax(scored[kept], -1) * F.log_softmax(logits[kept], -1)).sum(-1).mean()


def loss_of(pairs, decay: float) -> torch.Tensor:
    weights = [decay ** j for j in range(len(pairs))]
    return sum(w * step_loss(*pair) for w, pair in zip(weights, pairs)) / sum(weights)


@torch.no_grad()
def held_out_report(head, embed, data, settings: Eagle3Settings, vocab, vocab_size: int, k: int = 4) -> dict:
    """Each step's top-1 accuracy and the mean accepted length of a k-draft greedy chain over held-out answers
    (sequences without final states: the labels are the answer tokens)."""
    steps = max(settings.ttt_steps, k)
    right, counted, runs, rounds = torch.zeros(steps), torch.zeros(steps), 0.0, 0
    for item in data:
        pairs = step_losses(head, embed, batch_of([item], steps, vocab, vocab_size), steps)
        correct = torch.stack([(lg.argmax(-1) == lb) for lg, lb, _ in pairs])[:, 0]  # [steps, T]
        valid = torch.stack([lb != -100 for _, lb, _ in pairs])[:, 0]
        right += (correct & valid).sum(1).float()
        counted += valid.sum(1).float()
        usable = valid[:k].all(0)  # positions with k answer tokens after them
        chain = correct[:k].long().cumprod(0).sum(0)  # drafts accepted before the first miss
        runs += chain[usable].sum().item()
        rounds += int(usable.sum())
    return {"step_accuracy": [round(a, 4) for a in (right / counted.clamp(min=1)).tolist()],
            f"mean_accepted_length_k{k}": round(1 + runs / max(rounds, 1), 3)}


def train(model, answers: Answers, out: Path, settings: Eagle3Settings = Eagle3Settings(),
          base_model: str | None = None) -> dict:
    """Train a head on `answers` (resuming from OUT/train_state.pt), save it in OUT; the report."""
    began = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    held, kept, vocab = training_split(model, answers, settings.held_out, settings.seed, settings.draft_vocab)
    vocab_size = model.get_output_embeddings().weight.shape[0]
    torch.manual_seed(settings.seed)
    head = new_head(model, vocab)
    layers = head.config.aux_layers
    if max(layers) >= model.config.num_hidden_layers:
        raise ValueError(f"aux layers {layers}: training reads transformers' hidden_states below the last layer")

    def states(indices, finals: bool):
        data = []
        for n in tqdm(indices, desc="target states", unit="answer"):
            if len(answers.sequences[n]) - answers.prompt_lens[n] >= 2 and answers.prompt_lens[n] < settings.max_len:
                aux, final = aux_states(model, answers.sequences[n][:settings.max_len], layers, finals)
                data.append(TrainingSequence(aux, answers.sequences[n], answers.prompt_lens[n], final))
        return data

    train_data = states(kept, settings.labels == "distribution")
    embed = model.get_input_embeddings()
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=settings.lr)
    total = settings.epochs * -(-len(train_data) // settings.batch_size)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20) * max(
        0.1, 1 - s / max(total, 1)))

    def train_step(picked: torch.Tensor) -> float:
        batch = batch_of([train_data[i] for i in picked.tolist()], settings.ttt_steps, vocab, vocab_size)
        loss = loss_of(step_losses(head, embed, batch, settings.ttt_steps), settings.step_decay)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        return loss.item()

    head.train()
    run_training(settings, len(train_data), {"head": head, "optimizer": optimizer, "schedule": schedule},
                 out / "train_state.pt", "training the EAGLE-3 head", train_step)
    head.eval()
    architectures = tuple(getattr(model.config, "architectures", None) or ("LlamaForCausalLM",))
    save_speculators(head, out, verifier=base_model, verifier_architectures=architectures,
                     speculative_tokens=settings.ttt_steps)
    report = {"method": "eagle3", "prompts": len(answers.sequences), "answer_tokens": answers.answer_tokens,
              "train_sequences": len(train_data), "held_out_prompts": len(held), "steps": total,
              "settings": asdict(settings), "seconds": round(time.perf_counter() - began, 1)}
    if held:
        report["held_out"] = held_out_report(head, embed, states(held, False), settings, vocab, vocab_size)
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
