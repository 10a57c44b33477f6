"""Shared fixtures: a tiny word-level tokenizer and tiny random-weight causal LMs (no downloads, fast)."""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

# Without a GPU, Triton's kernels (engine/models/static/attention.py) run in its CPU interpreter, which Triton reads
# from the environment when it is first imported: set here, before any test module imports engine
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The suite's references for bf16 products are VDPBF16PS's bits (tests/engine/bf16_reference.py): on a CPU with AMX
# the process's measured choice (engine/models/cpu/bf16_products.py) could be AMX tiles instead, so tests fix
# VDPBF16PS, and the tests of AMX choose it themselves where the CPU has it
os.environ.setdefault("SPECSERVE_BF16_PRODUCT", "vdpbf16ps")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

TINY_VOCAB = 64
EOS_ID = 1


def make_tiny_tokenizer(vocab: int = TINY_VOCAB) -> PreTrainedTokenizerFast:
    """Words w2..w{vocab-1}; id 0 = <pad>, id 1 = </s>. Decoding joins words with spaces."""
    words = {"<pad>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")


def make_tiny_model(family: str = "llama", vocab: int = TINY_VOCAB, seed: int = 0, layers: int = 2):
    from transformers import (
        GemmaConfig,
        GemmaForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.3, eos_token_id=EOS_ID, bos_token_id=None, pad_token_id=0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None))
    elif family == "gemma":
        model = GemmaForCausalLM(GemmaConfig(**common, head_dim=16))
    elif family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=64, n_layer=layers, n_head=4, n_positions=256,
                                           initializer_range=0.3, eos_token_id=EOS_ID, bos_token_id=EOS_ID))
    else:
        raise ValueError(family)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def perturbed_copy(model, noise: float, seed: int = 1):
    """A draft that mostly agrees with `model`: the same weights plus Gaussian noise."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp(min=1e-3))
    return draft


def third_token_marginals(target, draft, prompt: list[int], vocab: int,
                          top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact marginal distributions [V] of the 3rd sampled token (temperature 1, optional top-k) under `target`
    and `draft`."""

    def probs(logits):  # [..., V]
        if top_k:
            kth = logits.topk(top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return logits.softmax(-1)

    def marginal(model):
        with torch.no_grad():
            p1 = probs(model(torch.tensor([prompt])).logits[0, -1])
            prefixes = torch.tensor([prompt + [a] for a in range(vocab)])
            p2 = probs(model(prefixes).logits[:, -1])  # [a, b]
            both = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
            p3 = probs(model(both).logits[:, -1]).view(vocab, vocab, vocab)
            return torch.einsum("a,ab,abc->c", p1, p2, p3)

    return marginal(target), marginal(draft)


def total_variation_bound(vocab: int, n: int) -> float:
    """4x the expected total-variation distance of an n-sample empirical distribution over `vocab` outcomes."""
    return 4 * 0.5 * math.sqrt(2 * vocab / (math.pi * n))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tiny_tokenizer()


BYTE_VOCAB = 288  # the byte tokenizer's 272 ids padded, as models pad their embedding tables
# merges of the byte tokenizer (in the byte-level alphabet, 'Ġ' is a space): a few multi-byte tokens, so a text
# has several tokenizations and drafts can straddle a grammar's boundaries
BYTE_MERGES = [("{", '"'), ('"', ":"), ('"', ","), ('"', "}"), ("Ġ", '"'), ("a", "b"), ("1", "2"), ("t", "r"),
               ("tr", "ue"), ("u", "e"), ("n", "u"), ("l", "l"), ("nu", "ll"), ("e", "s")]


def make_byte_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2's scheme) over the 256 byte symbols and BYTE_MERGES; id 0 = <pad>, id 1 = </s>. Any text
    tokenizes, so grammars (JSON, regexes) can be generated with it; llguidance reads it as it reads real models'."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "</s>": 1, **{ch: 2 + i for i, ch in enumerate(alphabet)}}
    for a, b in BYTE_MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=BYTE_MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")


def pytest_configure(config):
    # the servers tests start stop on SIGINT even where this run was started with SIGINT ignored (CI in the background)
    from bench.peer_servers import sigint_reaches_children

    sigint_reaches_children()
