"""Start-up of the sharded learner without a whole model on any rank.

Each rank builds the model on the meta device (shapes only, no memory), lets FSDP2 shard it there, allocates only
its own shards (`to_empty`) and reads only those rows from the safetensors files: a rank's start-up peak is its
shard, not the fp32 model plus an fp32 copy for the KL reference that the plain trainer's load takes. The files
are memory-mapped, so the ranks of one host share one page-cached copy of the weights.

Buffers that are not in the files (the rotary embedding's inverse frequencies) are recomputed by transformers'
own initializer; one it leaves unset is an error, never a silent garbage value.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch

from echo2cli.errors import ModelError, first_line


def meta_model(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The causal LM of `model_dir`'s config in `dtype`, every parameter and buffer on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    try:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as exc:  # transformers raises its own kinds for a missing or unknown config
        raise does_not_load(model_dir, exc) from exc
    if (Path(model_dir) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model


def does_not_load(model_dir: Path, exc: Exception) -> ModelError:
    """The one-line error for a model that transformers, safetensors or torch would not load: their first line."""
    return ModelError(f"model in {model_dir} does not load: {first_line(exc)}")


def is_meta(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or the shards a sharded checkpoint's index names)."""
    from safetensors import safe_open

    from echo2cli.models import safetensors_files

    files = safetensors_files(Path(model_dir))
    if not files:
        raise ModelError(f"model in {model_dir} does not load: no *.safetensors weights")
    where: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
    return where


def materialize(module: torch.nn.Module, model: torch.nn.Module, model_dir: Path, device: torch.device) -> None:
    """Allocate `module`'s (FSDP2-sharded, meta) parameters on `device` and fill them from `model_dir`:
    this rank's rows of each tensor only. `model` is the causal LM inside `module` (the names in the files)."""
    module.to_empty(device=device)
    model.tie_weights()  # to_empty off the meta device makes new parameters: tied ones would come apart
    with torch.no_grad():
        _init_buffers(model, model_dir)
        _load_local(model, model_dir)


def _init_buffers(model: torch.nn.Module, model_dir: Path) -> None:
    """Recompute the buffers the files do not hold, by transformers' initializer of the module owning them."""
    owners = [m for m in model.modules() if getattr(m, "_non_persistent_buffers_set", None)]
    for owner in owners:
        for name in owner._non_persistent_buffers_set:
            buffer = owner._buffers[name]
            if buffer is not None and not buffer.is_floating_point():
                raise ModelError(f"model in {model_dir}: {type(owner).__name__}.{name} cannot be rebuilt per rank")
            if buffer is not None:
                buffer.fill_(math.nan)
        model._init_weights(owner)
        for name in owner._non_persistent_buffers_set:
            buffer = owner._buffers[name]
            if buffer is not None and bool(buffer.isnan().any()):
                raise ModelError(
                    f"model in {model_dir}: {type(owner).__name__}.{name} is not set by transformers' initializer; "
                    "this architecture cannot start sharded (train it in one process: drop --nproc-per-node)"
                )


def _load_local(model: torch.nn.Module, model_dir: Path) -> None:
    from safetensors import safe_open

    where = weight_files(model_dir)
    non_persistent = {
        f"{prefix}.{b}" if prefix else b for prefix, m in model.named_modules() for b in m._non_persistent_buffers_set
    }
    wanted = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n not in non_persistent]
    missing = [name for name, _ in wanted if name not in where]
    if missing:
        raise ModelError(f"model in {model_dir} does not load: {len(missing)} tensors missing, e.g. {missing[0]}")
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(str(file), framework="pt")) for file in set(where.values())}
        for name, tensor in wanted:
            _copy_rows(tensor, handles[where[name]].get_slice(name), name, model_dir)


def _copy_rows(tensor: torch.Tensor, part: Any, name: str, model_dir: Path) -> None:
    """Copy this rank's part of the file's tensor `part` (a safetensors slice, read lazily) into `tensor`."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    full_shape = tuple(part.get_shape())
    if full_shape != tuple(tensor.shape):
        raise ModelError(f"model in {model_dir}: {name} is {list(full_shape)} in the file, {list(tensor.shape)} here")
    if isinstance(tensor, DTensor):
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        local = tensor.to_local()
        rows = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
        if local.numel():
            local.copy_(part[rows])
    else:
        tensor.copy_(part[:])
