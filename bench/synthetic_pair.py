"""A synthetic target/draft pair with known acceptance, written as Hugging Face directories (issue 34, item 6).

    python -m bench.synthetic_pair --shape 1.5b --noise 0 --out /tmp/pairs   # prints the two directories

Why: measuring a GPU server needs models of real shapes, and the GPU machines download nothing. A random-weight
Llama costs what a trained one of its shape costs (every step reads every weight), so its speed is the real one;
what random weights lack is a draft that agrees with the target, and that is built in:
- the target's layers from `draft_layers` (L) on have zero `o_proj` and `down_proj`, so attention and MLP add
  nothing and the residual passes through them unchanged, while the step still reads all their weights;
- the draft is exactly the target's first L layers with the same embeddings, final norm and head, so its logits
  are the target's and every greedy draft is accepted;
- `noise` > 0 puts noise in those zeroed projections (noise x the init's standard deviation 1/sqrt(fan_in):
  1 makes them full random layers), which moves the target away from the draft and lowers acceptance. The rate a
  given noise gives is measured, not promised (bench/gpu_serve.py reports it).

Shapes (SHAPES): `8b` is Llama-3.1-8B's (hidden 4096, 32 layers, 32/8 heads, vocabulary 128,256) with a 2-layer
draft whose step reads about 1B parameters (its layers and the 128,256-row head); `1.5b` is hidden 2048, 24 layers, 32/8
heads, vocabulary 49,152, tied embeddings, with a 2-layer draft of about 0.22B; `tiny` is for CPU tests. The tokenizer
is a word-level one made here with the shape's vocabulary (`synthetic_tokenizer`: "<pad>", "</s>", "<s>", then words
"w3" ...), so a pair needs no tokenizer file from anywhere (the GPU machines have no network) and its head is the real
shape's size; the benchmarks send token ids.

The random weights are scaled so that text is not degenerate: linear layers with std 1/sqrt(fan_in) keep every
layer's output the size of its input, embeddings small (std 0.02) so that a tied head does not simply repeat the
last token, and the final norm's weight sets the logits' spread (LOGIT_STD) so the greedy argmax depends on the
context. Tensors are made one at a time (on the GPU when there is one: fast) and written in safetensors shards, so
writing a pair holds at most a shard per model in host memory, never a model instance.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

LLAMA3_VOCAB, SMOLLM2_VOCAB = 128256, 49152
SPECIAL_TOKENS = ("<pad>", "</s>", "<s>")  # ids 0, 1 (end of sequence), 2 (beginning)
EMBED_STD = 0.02
LOGIT_STD = 3.0  # spread of the logits over the vocabulary (via the final norm's weight)
SHARD_BYTES = 2 << 30
ROPE_THETA = 500000.0
MAX_POSITIONS = 8192
DONE_MARK = ".complete"  # written last: a directory without it is an interrupted write


@dataclass(frozen=True)
class Shape:
    """A target's dimensions and how many of its first layers make the draft."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    draft_layers: int
    tie_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SHAPES = {
    "8b": Shape("8b", 4096, 14336, 32, 32, 8, LLAMA3_VOCAB, 2, False),
    "1.5b": Shape("1.5b", 2048, 8192, 24, 32, 8, SMOLLM2_VOCAB, 2, True),
    "tiny": Shape("tiny", 64, 128, 4, 4, 2, 512, 1, False),
}


# ---- sizes (no weights) --------------------------------------------------------------------------------------

def layer_params(shape: Shape) -> int:
    h, kv = shape.hidden, shape.kv_heads * shape.head_dim
    return h * (2 * h + 2 * kv) + 3 * h * shape.intermediate + 2 * h  # q, o, k, v; gate, up, down; two norms


def param_counts(shape: Shape) -> dict[str, int]:
    """Parameters of the target and the draft, and those a decode step reads (all but an untied embedding table,
    of which a step reads one row per token): the roofline's weight bytes are the latter x 2 (bf16)."""
    embed = shape.vocab * shape.hidden
    head = 0 if shape.tie_embeddings else embed

    def model(layers: int) -> int:
        return embed + layers * layer_params(shape) + shape.hidden + head

    skipped = 0 if shape.tie_embeddings else embed
    target, draft = model(shape.layers), model(shape.draft_layers)
    return {"target": target, "draft": draft, "target_read": target - skipped, "draft_read": draft - skipped}


def llama_config(shape: Shape, layers: int, bos: int | None = None, eos: int | None = None):
    """The transformers config of the target (layers = shape.layers) or the draft (shape.draft_layers)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                       num_hidden_layers=layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                       head_dim=shape.head_dim, max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5,
                       rope_theta=ROPE_THETA, tie_word_embeddings=shape.tie_embeddings, bos_token_id=bos,
                       eos_token_id=eos, dtype="bfloat16")


# ---- tensors ---------------------------------------------------------------------------------------------------

def _randn(rows: int, cols: int, std: float, gen: torch.Generator) -> torch.Tensor:
    """[rows, cols] bf16 on the host, drawn on the generator's device."""
    out = torch.randn(rows, cols, generator=gen, device=gen.device, dtype=torch.float32)
    return out.mul_(std).to(torch.bfloat16).cpu()


def layer_tensors(shape: Shape, i: int, noise: float, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Layer i's weights ([out, in], as transformers names them); from draft_layers on, o_proj and down_proj are
    noise x their init (zero for noise 0: the layer passes the residual through)."""
    h, kv, inter = shape.hidden, shape.kv_heads * shape.head_dim, shape.intermediate
    live = i < shape.draft_layers
    p = f"model.layers.{i}."
    out = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
           p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for name, rows, cols in (("self_attn.q_proj", h, h), ("self_attn.k_proj", kv, h), ("self_attn.v_proj", kv, h),
                             ("self_attn.o_proj", h, h), ("mlp.gate_proj", inter, h), ("mlp.up_proj", inter, h),
                             ("mlp.down_proj", h, inter)):
        scale = 1.0 if live or name not in ("self_attn.o_proj", "mlp.down_proj") else noise
        out[p + name + ".weight"] = (_randn(rows, cols, scale / math.sqrt(cols), gen) if scale
                                     else torch.zeros(rows, cols, dtype=torch.bfloat16))
    return out


def shared_tensors(shape: Shape, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Embeddings, final norm and head: the same in target and draft."""
    head_std = EMBED_STD if shape.tie_embeddings else 1.0 / math.sqrt(shape.hidden)
    out = {"model.embed_tokens.weight": _randn(shape.vocab, shape.hidden, EMBED_STD, gen),
           "model.norm.weight": torch.full((shape.hidden,), LOGIT_STD / (head_std * math.sqrt(shape.hidden)),
                                           dtype=torch.bfloat16)}
    if not shape.tie_embeddings:
        out["lm_head.weight"] = _randn(shape.vocab, shape.hidden, head_std, gen)
    return out


def pair_tensors(shape: Shape, noise: float, seed: int, device: str = "cpu"
                 ) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """(name, tensor, also in the draft) for every target tensor, one at a time, from one seeded generator."""
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, tensor in shared_tensors(shape, gen).items():
        yield name, tensor, True
    for i in range(shape.layers):
        for name, tensor in layer_tensors(shape, i, noise, gen).items():
            yield name, tensor, i < shape.draft_layers


# ---- writing ---------------------------------------------------------------------------------------------------

class ShardWriter:
    """Safetensors shards of at most `shard_bytes` and, for more than one, the index transformers reads."""

    def __init__(self, directory: Path, shard_bytes: int = SHARD_BYTES):
        self.directory, self.shard_bytes = directory, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.files: list[str] = []
        self.weight_map: dict[str, str] = {}
        self.pending_bytes = self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        name = f"model-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(self.directory / name), metadata={"format": "pt"})
        self.weight_map.update({key: name for key in self.pending})
        self.files.append(name)
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        """One shard is `model.safetensors`; several get `model.safetensors.index.json`."""
        from safetensors.torch import save_file

        if not self.files:
            save_file(self.pending, str(self.directory / "model.safetensors"), metadata={"format": "pt"})
            return
        if self.pending:
            self._flush()
        index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def synthetic_tokenizer(vocab: int):
    """A word-level tokenizer of exactly `vocab` tokens: the special tokens, then "w3" ... (decoding joins words
    with spaces). Made in memory, so writing a pair reads no file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    words.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>")


def pair_dir(root: Path, shape: Shape, noise: float, seed: int) -> Path:
    return Path(root) / f"{shape.name}-noise{noise:g}-seed{seed}"


def write_pair(shape: Shape, root: Path, noise: float = 0.0, seed: int = 0, device: str = "cpu",
               tokenizer=None, shard_bytes: int = SHARD_BYTES) -> tuple[Path, Path]:
    """(target dir, draft dir) under root/<shape>-noise<n>-seed<s>/, written once: a later call with the same
    arguments reuses a complete pair. `device` draws the random numbers (cuda: seconds for the 8b shape)."""
    base = pair_dir(root, shape, noise, seed)
    target_dir, draft_dir = base / "target", base / "draft"
    if (base / DONE_MARK).is_file():
        return target_dir, draft_dir
    shutil.rmtree(base, ignore_errors=True)
    tokenizer = tokenizer if tokenizer is not None else synthetic_tokenizer(shape.vocab)
    if len(tokenizer) > shape.vocab:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, the shape's vocabulary {shape.vocab}")
    for directory, layers in ((target_dir, shape.layers), (draft_dir, shape.draft_layers)):
        directory.mkdir(parents=True)
        llama_config(shape, layers, tokenizer.bos_token_id, tokenizer.eos_token_id).save_pretrained(directory)
        tokenizer.save_pretrained(directory)
    target, draft = ShardWriter(target_dir, shard_bytes), ShardWriter(draft_dir, shard_bytes)
    for name, tensor, in_draft in pair_tensors(shape, noise, seed, device):
        target.add(name, tensor)
        if in_draft:
            draft.add(name, tensor)
    target.close()
    draft.close()
    meta = {"shape": asdict(shape), "noise": noise, "seed": seed, "params": param_counts(shape),
            "tokenizer": f"word-level, {len(tokenizer)} tokens (bench/synthetic_pair.synthetic_tokenizer)"}
    (base / "pair.json").write_text(json.dumps(meta, indent=1))
    (base / DONE_MARK).write_text("")
    return target_dir, draft_dir


# ---- heads beside the pair -------------------------------------------------------------------------------------

MEDUSA_HEADS = 4  # FasterDecoding's Medusa-1 checkpoints have 4-5 heads of one ResBlock
EAGLE3_DRAFT_VOCAB = 32000  # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's draft vocabulary


def write_heads(shape: Shape, target_dir: Path, seed: int = 0) -> dict[str, Path]:
    """Random-weight heads of the target's shape beside the pair, written once: {"medusa": DIR, "eagle3": DIR}.

    They cost what trained heads of their shape cost, which is what they are for (drafting's share of a round,
    the plan keeping them off); their drafts are random, so their acceptance means nothing. EAGLE-3: one layer of
    the target's width with a draft vocabulary of min(32000, vocab / 2) tokens and the default aux layers
    (bench/eagle3_cost.random_head), in speculators' format. Medusa: MEDUSA_HEADS heads of one ResBlock that share
    the target's LM head (at Llama-3's 128k vocabulary a head's own LM head would be 0.5B parameters)."""
    from bench.eagle3_cost import random_head
    from engine.proposers.eagle3_checkpoint import save_speculators
    from engine.proposers.medusa import MedusaConfig, MedusaHeads

    base = target_dir.parent
    dirs = {"medusa": base / "medusa", "eagle3": base / "eagle3"}
    if (base / (DONE_MARK + "-heads")).is_file():
        return dirs
    torch.manual_seed(seed)
    medusa = MedusaHeads(MedusaConfig(MEDUSA_HEADS, 1, shape.hidden, shape.vocab, shared_lm_head=True))
    with torch.no_grad():
        for name, param in medusa.named_parameters():
            param.normal_(0.0, 1.0 / math.sqrt(shape.hidden) if name.endswith("weight") else 0.0)
    medusa.to(torch.bfloat16).save(dirs["medusa"], str(target_dir))
    n = shape.layers  # the default low / middle / high layers coincide on a shallow (test) shape
    aux = None if n >= 8 else (1, n // 2, n - 1)
    head = random_head(llama_config(shape, n), min(EAGLE3_DRAFT_VOCAB, shape.vocab // 2), seed, aux)
    save_speculators(head.to(torch.bfloat16), dirs["eagle3"], verifier=str(target_dir))
    (base / (DONE_MARK + "-heads")).write_text("")
    return dirs


def default_root() -> Path:
    from engine.models.loading import cache_root

    return cache_root() / "synthetic"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--noise", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="root directory (default: $SPECSERVE_CACHE/synthetic)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the random numbers are drawn")
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    target, draft = write_pair(shape, Path(args.out) if args.out else default_root(), args.noise, args.seed,
                               args.device)
    print(json.dumps({"target": str(target), "draft": str(draft), **param_counts(shape)}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
