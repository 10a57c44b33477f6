"""EAGLE-3 head checkpoints in the two formats their users have (`model.draft: eagle3:DIR`), and the one this project
writes (`specserve train-heads --method eagle3`).

- **speculators** (vLLM's library; `vllm serve DIR` runs it): config.json with `speculators_model_type: eagle3`,
  `transformer_layer_config` (the decoder layer's LlamaConfig), `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids`,
  `target_hidden_size`, the norm flags and `speculators_config` (algorithm, proposal, verifier); weights in
  model.safetensors named as engine/proposers/eagle3_head.py names them (`fc`, `layers.0.*`, `norm`, `lm_head`,
  `d2t`, `t2d`; `embed_tokens` optional: the target's is used without it).
- **EAGLE's own** (`yuhuili/EAGLE3-*`, what SGLang and SpecForge read and write): config.json is a LlamaConfig of
  the layer plus `draft_vocab_size` (and optionally `target_hidden_size`); weights in pytorch_model.bin or
  model.safetensors with the layer named `midlayer.*`; its aux layers are the default 2, N // 2, N - 3.

A head that cannot read this target is refused at start (`Eagle3Error`), naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig

from engine.proposers.eagle3_head import Eagle3Config, Eagle3Head, default_aux_layers

NORM_FLAGS = ("norm_before_residual", "norm_output", "norm_before_fc", "fc_norm")
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose config this project writes and tests against


class Eagle3Error(ValueError):
    """An EAGLE-3 checkpoint that cannot serve this target: the message names the field."""


def load_eagle3(directory: str | Path, hidden_size: int, vocab_size: int, num_layers: int) -> Eagle3Head:
    """The head in `directory` (either format), checked against the target's hidden size, vocabulary and layer
    count."""
    directory = Path(directory)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise Eagle3Error(f"model.draft: no EAGLE-3 config.json in {directory}")
    meta = json.loads(config_file.read_text())
    state = _weights(directory)
    if "speculators_model_type" in meta:
        if meta["speculators_model_type"] != "eagle3":
            raise Eagle3Error(f"{config_file}: speculators_model_type {meta['speculators_model_type']!r} is not "
                              f"an EAGLE-3 head (eagle3)")
        layer = meta.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise Eagle3Error(f"{config_file} has no transformer_layer_config")
        aux = meta.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(num_layers)
        extra = {flag: bool(meta.get(flag, False)) for flag in NORM_FLAGS}
        field = "transformer_layer_config."
    else:
        if "draft_vocab_size" not in meta:
            raise Eagle3Error(f"{config_file} is neither a speculators config (speculators_model_type) nor EAGLE's "
                              f"(draft_vocab_size)")
        layer, aux, extra, field = dict(meta), default_aux_layers(num_layers), {}, ""
        state = {k.replace("midlayer.", "layers.0.", 1) if k.startswith("midlayer.") else k: v
                 for k, v in state.items()}
        if "t2d" in state:  # EAGLE's config may carry the draft vocabulary's size as vocab_size
            layer["vocab_size"] = state["t2d"].shape[0]
    if layer.get("model_type", "llama") != "llama":
        raise Eagle3Error(f"{config_file}: {field}model_type {layer.get('model_type')!r}; EAGLE-3 heads here have a "
                          f"Llama decoder layer")
    if layer.get("hidden_act", "silu") != "silu":
        raise Eagle3Error(f"{config_file}: {field}hidden_act {layer.get('hidden_act')!r}; only silu is supported")
    if layer.get("num_hidden_layers", 1) != 1:
        raise Eagle3Error(f"{config_file}: {field}num_hidden_layers {layer['num_hidden_layers']}; EAGLE-3 heads here "
                          f"have one decoder layer")
    layer = LlamaConfig(**{k: v for k, v in layer.items() if k not in ("architectures", "model_type")})
    if layer.vocab_size != vocab_size:
        raise Eagle3Error(f"EAGLE-3 head for a vocabulary of {layer.vocab_size} ({field}vocab_size) cannot draft for "
                          f"this target (vocab_size {vocab_size})")
    target_hidden = meta.get("target_hidden_size") or layer.hidden_size
    if target_hidden != hidden_size:
        raise Eagle3Error(f"EAGLE-3 head reads target states of hidden_size {target_hidden} (target_hidden_size), "
                          f"this target's are {hidden_size}")
    if "embed_tokens.weight" not in state and layer.hidden_size != hidden_size:
        raise Eagle3Error(f"EAGLE-3 head of {field}hidden_size {layer.hidden_size} has no embed_tokens and cannot "
                          f"read this target's embeddings (hidden_size {hidden_size})")
    aux = tuple(int(i) for i in aux)
    if not aux or min(aux) < 0 or max(aux) > num_layers or len(set(aux)) != len(aux):
        raise Eagle3Error(f"EAGLE-3 head reads layers {list(aux)} (eagle_aux_hidden_state_layer_ids); this target "
                          f"has {num_layers} (num_hidden_layers)")
    draft_vocab = int(meta.get("draft_vocab_size", layer.vocab_size))
    head = Eagle3Head(Eagle3Config(layer, draft_vocab, aux, target_hidden, **extra))
    fc = state.get("fc.weight")
    if fc is None or fc.shape != head.fc.weight.shape:
        raise Eagle3Error(f"EAGLE-3 checkpoint {directory}: fc.weight of shape {None if fc is None else list(fc.shape)}"
                          f", expected {list(head.fc.weight.shape)} ({len(aux)} aux layers x target_hidden_size "
                          f"{target_hidden})")
    if "embed_tokens.weight" in state:
        head.embed_tokens = torch.nn.Embedding(*state["embed_tokens.weight"].shape)
    if head.d2t is not None and "d2t" not in state:
        raise Eagle3Error(f"EAGLE-3 checkpoint {directory}: draft_vocab_size {draft_vocab} below the vocabulary "
                          f"but no d2t mapping")
    state = {k: (v if k in ("d2t", "t2d") else v.float()) for k, v in state.items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise Eagle3Error(f"EAGLE-3 checkpoint {directory}: missing {sorted(missing)[:4]}, unexpected "
                          f"{sorted(unexpected)[:4]}")
    return head.eval()


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    if (directory / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(directory / "model.safetensors"))
    if (directory / "pytorch_model.bin").is_file():
        return torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise Eagle3Error(f"model.draft: neither model.safetensors nor pytorch_model.bin in {directory} "
                      f"(sharded checkpoints are not read)")


def save_speculators(head: Eagle3Head, directory: str | Path, verifier: str | None = None,
                     verifier_architectures: tuple[str, ...] = ("LlamaForCausalLM",),
                     speculative_tokens: int = 3) -> None:
    """The head as a speculators checkpoint (config.json + model.safetensors), which vLLM serves and
    `load_eagle3` reads; `verifier` the target's name or path, recorded for `vllm serve`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    c = head.config
    layer = c.layer.to_dict()
    layer.pop("architectures", None)
    layer["model_type"] = "llama"
    meta = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
        **{flag: getattr(c, flag) for flag in NORM_FLAGS},
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }
    (directory / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in head.state_dict().items() if not k.startswith("rotary.")}
    save_file(state, str(directory / "model.safetensors"))
