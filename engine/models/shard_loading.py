"""Loading one tensor-parallel rank's shard of a model straight from its safetensors files.

The model is first built on the `meta` device (shapes only, no memory), its projections, embedding and LM head are
replaced by the parallel modules of engine/models/tensor_parallel.py, and every tensor is read with
`safe_open(...).get_slice(name)[range]`: a column-parallel weight reads a row range of its [out, in] matrix, a
row-parallel one a column range, the vocabulary shards a row range, replicated norms all of it. safetensors maps
the file and copies only the requested range, so a rank never holds the full weights (Megatron-LM's layout,
Shoeybi et al. 2019, arXiv 1909.08053; the same per-rank loading as vLLM's `weight_loader`s). A sharded checkpoint
(`model.safetensors.index.json`) is read through its index; GGUF models reach here as the safetensors directory
engine/models/loading.py converted them to (once, whole: that conversion is the one time a full copy exists).

Non-persistent buffers (the rotary `inv_freq`) are not in checkpoints: they are recomputed on the real device by
the model's own `_init_weights`, as transformers' `from_pretrained` does after its meta-device load.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.models.loading import DTYPES, ModelLoadError, ResolvedModel
from engine.models.tensor_parallel import (
    COLUMNS,
    ROWS,
    WHOLE,
    TensorParallelError,
    install_shards,
    part_range,
    part_shape,
)

INDEX_FILE = "model.safetensors.index.json"


def rank_device(device: str) -> torch.device:
    """The device this rank computes on; a CUDA device is also made current on the calling thread.

    "cuda" (no index) means this process's own GPU. A Ray worker actor asks for one GPU (`num_gpus`), and Ray sets
    CUDA_VISIBLE_DEVICES to it, so it is the only visible device, index 0; under torchrun every GPU of the node is
    visible and LOCAL_RANK names this process's. Hence: index 0 when one device is visible, else LOCAL_RANK (default
    0). An explicit index ("cuda:1") is used as given. `torch.cuda.set_device` is per thread: call this on the
    thread that runs the model.
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    if dev.index is None:
        visible = torch.cuda.device_count()
        index = 0 if visible == 1 else int(os.environ.get("LOCAL_RANK", 0))
        if not 0 <= index < visible:
            raise RuntimeError(f"LOCAL_RANK {index} names no CUDA device: {visible} visible to this process")
        dev = torch.device("cuda", index)
    torch.cuda.set_device(dev)
    return dev


class _Checkpoint:
    """A safetensors checkpoint (one file, several, or an index of shards), read by tensor name and range."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._files = contextlib.ExitStack()
        self._open: dict[Path, object] = {}
        index = directory / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._where = {name: directory / file for name, file in weight_map.items()}
        else:
            files = sorted(directory.glob("*.safetensors"))
            if not files:
                raise ModelLoadError(f"no .safetensors weights in {directory}; specserve does not load pickled "
                                     f"(.bin/.pt) weights")
            self._where = {name: path for path in files for name in self._file(path).keys()}

    def __enter__(self) -> "_Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self._files.close()

    def _file(self, path: Path):
        if path not in self._open:
            self._open[path] = self._files.enter_context(safe_open(str(path), framework="pt"))
        return self._open[path]

    def read(self, name: str, split: str, rank: int, world: int) -> torch.Tensor:
        """This rank's part of tensor `name` (tensor_parallel.ROWS / COLUMNS / WHOLE), and nothing more."""
        if name not in self._where:
            raise ModelLoadError(f"tensor {name!r} is not in the checkpoint in {self.directory}")
        part = self._file(self._where[name]).get_slice(name)
        shape = part.get_shape()
        if split == ROWS:
            return part[part_range(shape[0], rank, world)]
        if split == COLUMNS:
            return part[:, part_range(shape[1], rank, world)]
        return part[:]


def _skeleton(resolved: ResolvedModel, dtype: torch.dtype, trust_remote_code: bool) -> nn.Module:
    """The model with every parameter and buffer on the meta device (no memory, no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(resolved.directory, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa",
                                                    trust_remote_code=trust_remote_code)
    except Exception as exc:
        raise ModelLoadError(f"cannot build the model of {resolved.directory} ({resolved.source}): {exc}") from exc


def _fill_replicated(model: nn.Module, take) -> None:
    """Load whole every parameter and persistent buffer still on meta (norms), keeping tied ones tied."""
    loaded: dict[int, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        persistent = [n for n in module._buffers if n not in module._non_persistent_buffers_set]
        for kind, names in (("_parameters", list(module._parameters)), ("_buffers", persistent)):
            tensors = getattr(module, kind)
            for name in names:
                t = tensors[name]
                if t is None or not t.is_meta:
                    continue
                if id(t) not in loaded:
                    value = take(f"{prefix}.{name}" if prefix else name, WHOLE)
                    loaded[id(t)] = nn.Parameter(value, requires_grad=False) if kind == "_parameters" else value
                tensors[name] = loaded[id(t)]


def _recompute_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary inv_freq) recomputed on `device` by the model's own `_init_weights`, as
    `from_pretrained` does; every loaded tensor is marked initialized first, so none is touched."""
    for t in [*model.parameters(), *model.buffers()]:
        if not t.is_meta:
            t._is_hf_initialized = True
    for prefix, module in model.named_modules():
        meta = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not meta:
            continue
        for name in meta:
            old = module._buffers[name]
            module._buffers[name] = torch.full(old.shape, float("nan"), dtype=old.dtype, device=device) \
                if old.dtype.is_floating_point else torch.zeros(old.shape, dtype=old.dtype, device=device)
        with torch.no_grad():
            model._init_weights(module)
        for name in meta:
            b = module._buffers[name]
            if b.dtype.is_floating_point and torch.isnan(b).any():
                raise ModelLoadError(f"cannot recompute buffer {prefix}.{name} of {type(module).__name__} for a "
                                     f"tensor-parallel load (the model's _init_weights does not set it)")


def load_shard(resolved: ResolvedModel, dtype: str, device: str, rank: int, world: int, group=None,
               trust_remote_code: bool = False) -> nn.Module:
    """Rank `rank` of `world`'s shard of a Llama-style causal LM, on `device`, read from its safetensors files.

    Gives the same logits as `load_causal_lm`'s model (with every rank in the process group `group` running it),
    and holds 1/world of each split tensor. `dtype` as load_causal_lm's; int8 (weight-only quantization of the
    full model) is not supported for tensor-parallel targets.
    """
    if dtype == "int8":
        raise TensorParallelError("target dtype int8 is not supported for tensor-parallel targets (tp_size > 1): "
                                  "use float32, bfloat16 or float16")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(d for d in DTYPES if d != 'int8')}")
    torch_dtype, dev = DTYPES[dtype], rank_device(device)
    model = _skeleton(resolved, torch_dtype, trust_remote_code)
    expected = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}

    with _Checkpoint(resolved.directory) as checkpoint:
        def take(name: str, split: str) -> torch.Tensor:
            part = checkpoint.read(name, split, rank, world)
            want = part_shape(expected[name], split, world) if name in expected else None
            if tuple(part.shape) != want:
                raise ModelLoadError(f"tensor {name!r} in {resolved.directory}: rank {rank}'s part has shape "
                                     f"{tuple(part.shape)}, the model expects {want}")
            return part.to(device=dev, dtype=torch_dtype if part.dtype.is_floating_point else part.dtype)

        install_shards(model, take, rank, world, group)
        _fill_replicated(model, take)
    _recompute_buffers(model, dev)
    model.to(dev)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ModelLoadError(f"tensor-parallel load of {resolved.directory} left {left} unset")
    if (resolved.directory / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(resolved.directory)
    return model.eval()
