"""A smaller real model for the runs whose checks do not depend on what the model says (churn, restarts, the
sharded learner, a late joiner, multi-turn plumbing): the default model cut to its first `layers` decoder layers,
with its own embedding, tokenizer and chat template. vLLM, the trainer and the swarm treat it as any Llama; its
version is 71 MB in bf16 against the default's 269 MB, and its passes are ~15x cheaper per layer stack.

Built once into the echo2 cache beside the default model (`ECHO2_CACHE`), in about a second; a run whose checks read
rewards, accuracies or log-probs keeps the full default model."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from echo2cli.layout import WEIGHTS_FILE as WEIGHTS
from echo2cli.models import cache_dir, copy_model_files, prepare_default_model


def plumbing_model(layers: int = 2) -> Path:
    """The default model's first `layers` decoder layers, as a model directory (built on first use)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = cache_dir() / f"SmolLM2-135M-Instruct-{layers}-layers"
    if (out / WEIGHTS).exists() and (out / "config.json").exists():
        return out
    default = prepare_default_model()
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    copy_model_files(default, tmp)
    config = json.loads((default / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    kept = {}
    with safe_open(str(default / WEIGHTS), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            parts = name.split(".")
            if parts[:2] == ["model", "layers"] and int(parts[2]) >= layers:
                continue
            kept[name] = f.get_tensor(name)
    save_file(kept, str(tmp / WEIGHTS), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
