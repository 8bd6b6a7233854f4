"""LoRA versions (`echo2 learner --lora-rank R`): the learner trains adapters on a frozen base, and a version is
its adapter file, a few MB where the full weights are hundreds.

    version 0     the base's full weights (bf16), published once and seeded for the whole run
    version v > 0 the adapters (PEFT's tensor names, bf16): `versions/v<v>/model.safetensors` like any version,
                  so the swarm, the web seed and the checks treat it as they treat full weights

A worker starts its engine on version 0 with LoRA enabled and loads each later version as the vLLM adapter
`v<v>`, keeping S + 2 of them; an adapter's name is part of vLLM's prefix-cache keys, so no cached prompt of
one version is reused by another. It writes the adapter's `adapter_config.json` itself from the run's LoraSpec
(`adapter_dir`); the learner does the same beside each version it publishes, after making its torrent, so that
`echo2 eval` and the periodic evaluation can merge a version into full weights (`write_merged`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2cli.layout import WEIGHTS_FILE
from echo2cli.protocol import LoraSpec

if TYPE_CHECKING:
    import torch

DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj"  # attention only: 1.4 % of the default model's bytes at r = 16
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
PEFT_PREFIX = "base_model.model."  # PEFT's names: PEFT_PREFIX + <layer> + .lora_A.weight
BF16_BYTES = 2  # the learner publishes adapters in bf16 (learner/publisher.py)
HEADER_BYTES = 4096  # a safetensors header's length field, `__metadata__` and padding, with room to spare
HEADER_BYTES_PER_TENSOR = 128  # a tensor's header entry besides its name: dtype, shape, offsets (~90 characters)


def lora_spec(rank: int, alpha: int, targets: str) -> LoraSpec | None:
    """The run's spec from the learner's options (rank 0: full fine-tuning); alpha 0 means 2 x rank."""
    if rank <= 0:
        return None
    names = [t.strip() for t in targets.split(",") if t.strip()]
    return LoraSpec(rank=rank, alpha=alpha or 2 * rank, targets=names)


def vllm_rank(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds `rank`."""
    return next(r for r in VLLM_RANKS if r >= rank)


def peft_config(spec: LoraSpec) -> dict:
    """`adapter_config.json`: what PEFT and vLLM read. No dropout: workers generate with the adapter as trained."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "target_modules": list(spec.targets),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "modules_to_save": None,
    }


def adapter_dir(version_dir: Path, spec: LoraSpec) -> Path:
    """`version_dir` (holding a version's model.safetensors) made loadable as a PEFT adapter: its config and
    `adapter_model.safetensors`, a link to the version file. Neither is in the version's torrent; both go with
    the directory when the version is pruned."""
    (version_dir / ADAPTER_CONFIG).write_text(json.dumps(peft_config(spec)))
    link = version_dir / ADAPTER_FILE
    if not link.is_symlink():
        link.unlink(missing_ok=True)
        os.symlink(WEIGHTS_FILE, link)
    return version_dir


def is_adapter(version_dir: Path) -> bool:
    return (version_dir / ADAPTER_CONFIG).is_file()


def spec_of(version_dir: Path) -> LoraSpec:
    cfg = json.loads((version_dir / ADAPTER_CONFIG).read_text())
    return LoraSpec(rank=cfg["r"], alpha=cfg["lora_alpha"], targets=cfg["target_modules"])


def base_name(adapter_key: str) -> tuple[str, str] | None:
    """PEFT's `base_model.model.<layer>.lora_A.weight` -> (`<layer>.weight`, "A"); None for another name."""
    stem = adapter_key.removeprefix("base_model.model.")
    for part in ("A", "B"):
        suffix = f".lora_{part}.weight"
        if stem.endswith(suffix):
            return stem.removesuffix(suffix) + ".weight", part
    return None


def merge(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], spec: LoraSpec) -> dict[str, torch.Tensor]:
    """Full weights with the adapters folded in: W + (alpha / r) B A for each adapted layer, in W's dtype."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapter.items():
        named = base_name(key)
        if named is None or named[0] not in base:
            raise ValueError(f"adapter tensor {key[:120]} adapts no layer of the base")
        pairs.setdefault(named[0], {})[named[1]] = tensor
    scale = spec.alpha / spec.rank
    merged = dict(base)
    for name, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"layer {name} has lora_{''.join(ab)} without its pair")
        w = base[name]
        merged[name] = (w.float() + scale * (ab["B"].float() @ ab["A"].float())).to(w.dtype)
    return merged


def targeted(layer: str, spec: LoraSpec) -> bool:
    """`layer` (`model.layers.0.self_attn.q_proj.weight`) is one PEFT gives an adapter: its module's own name is one
    of the spec's targets."""
    return layer.removesuffix(".weight").rpartition(".")[2] in spec.targets


def max_adapter_bytes(base_shapes: dict[str, tuple[int, ...]], spec: LoraSpec) -> int:
    """The largest adapter file `check_adapter` accepts on a base with these tensor shapes: for each targeted 2-D
    layer W (out x in), lora_A (r x in) and lora_B (out x r) in bf16, r (in + out) 2 bytes, and their two header
    entries. A worker refuses an adapter version announced larger before fetching a byte of it."""
    total = HEADER_BYTES
    for layer, shape in base_shapes.items():
        if len(shape) == 2 and targeted(layer, spec):
            out, inp = shape
            name_len = len(PEFT_PREFIX) + len(layer.removesuffix(".weight")) + len(".lora_A.weight")  # = lora_B's
            total += spec.rank * (inp + out) * BF16_BYTES + 2 * (name_len + HEADER_BYTES_PER_TENSOR)
    return total


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor in safetensors file `path`, from its header alone; ValueError if it has none."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:  # safetensors raises its own error types on a malformed header
        raise ValueError(f"not a safetensors file ({exc})") from exc


def check_adapter(adapter_file: Path, base_file: Path, spec: LoraSpec) -> None:
    """ValueError unless every tensor in `adapter_file` is the A or B of a layer of the base in `base_file` that the
    spec targets, of the spec's rank and that layer's shape, each with its pair. vLLM copies adapter tensors into
    buffers sized for the base without checking them (a 16 x 7 lora_A loads and generates), so a worker checks the
    file first: only the files' headers are read."""
    shapes = tensor_shapes(base_file)
    adapter = tensor_shapes(adapter_file)
    pairs: dict[str, set[str]] = {}
    for key, shape in adapter.items():
        named = base_name(key)
        layer = shapes.get(named[0]) if named else None
        if named is None or layer is None or len(layer) != 2:
            raise ValueError(f"tensor {key[:120]} adapts no layer of the base")
        if not targeted(named[0], spec):
            raise ValueError(f"tensor {key[:120]} adapts a layer the run does not target ({', '.join(spec.targets)})")
        want = (spec.rank, layer[1]) if named[1] == "A" else (layer[0], spec.rank)
        if shape != want:
            raise ValueError(f"tensor {key[:120]} is {list(shape)}, not {list(want)}")
        pairs.setdefault(named[0], set()).add(named[1])
    if not pairs or any(len(p) != 2 for p in pairs.values()):
        raise ValueError("an adapted layer lacks its lora_A or lora_B, or there is no adapter at all")


# -- the learner's side: PEFT adapters on the trainer's model ---------------------------------------------------


def attach_adapters(model: torch.nn.Module, spec: LoraSpec) -> Any:
    """PEFT's LoRA layers injected into `model` (in place; every other parameter frozen); the PeftModel."""
    from peft import LoraConfig, get_peft_model

    from echo2cli.errors import ModelError

    config = LoraConfig(
        r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0, bias="none"
    )
    try:
        return get_peft_model(model, config)
    except ValueError as exc:  # a target that names no layer of this model
        raise ModelError(f"--lora-targets {','.join(spec.targets)}: {exc}") from exc


def adapter_state(peft: Any) -> dict[str, torch.Tensor]:
    """The adapters' tensors, named as PEFT saves them (`base_model.model.<layer>.lora_A.weight`)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft)


def base_state_published(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The frozen base's weights of a model with adapters, in `dtype` (the wire dtype) on the CPU, named as without
    them; a tied lm_head is left out as HF does."""
    state = {
        k.replace(".base_layer.", "."): v.detach().to("cpu", dtype).contiguous()
        for k, v in model.state_dict().items()
        if ".lora_" not in k
    }
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    return state


def save_adapters(peft: Any, directory: Path) -> None:
    """A checkpoint's weights: the adapters (fp32) with their config, and the model's config."""
    peft.save_pretrained(str(directory))
    peft.get_base_model().config.save_pretrained(directory)
    (directory / "README.md").unlink(missing_ok=True)  # PEFT's model card template


def load_adapters(peft: Any, directory: Path, device: torch.device) -> None:
    """`save_adapters`' adapters back into `peft`; ValueError if they do not fit its rank and targets."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    if not (directory / ADAPTER_FILE).is_file():
        raise ValueError(f"{directory} holds no {ADAPTER_FILE}: it is not a checkpoint of a LoRA run")
    result: Any = set_peft_model_state_dict(peft, load_file(str(directory / ADAPTER_FILE), device=str(device)))
    missing = [k for k in result.missing_keys if ".lora_" in k]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint adapters do not fit --lora-rank/--lora-targets: missing {missing[:3]}, "
            f"unexpected {result.unexpected_keys[:3]}"
        )


# -- full weights from adapters ----------------------------------------------------------------------------


def merged_weights(adapter: Path, base: Path) -> dict[str, torch.Tensor]:
    """The adapters in directory `adapter` (a published version's, or a checkpoint's) folded into the full weights
    in file `base` (version 0 of the run)."""
    from safetensors.torch import load_file

    if not base.is_file():
        raise FileNotFoundError(f"{base}: the base of the LoRA adapters in {adapter} is gone")
    return merge(load_file(str(base)), load_file(str(adapter / ADAPTER_FILE)), spec_of(adapter))


def write_merged(dest: Path, adapter: Path, base: Path) -> None:
    """`dest/model.safetensors`: `merged_weights`, for an engine or a tool that wants full weights."""
    from safetensors.torch import save_file

    save_file(merged_weights(adapter, base), str(dest / WEIGHTS_FILE), metadata={"format": "pt"})
