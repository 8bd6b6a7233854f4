"""vLLM engine on this host: start-up time and rollout tokens/s for the engine settings echo2 uses
(eager, fp32 on a CPU without bf16) against a baseline setting, each in a fresh process, same run.

    .venv/bin/python scripts/bench_engine.py --baseline compiled   # torch.compile warm-up vs eager
    .venv/bin/python scripts/bench_engine.py --baseline bf16       # emulated bf16 vs fp32 (CPU without bf16)
    .venv/bin/python scripts/bench_engine.py --baseline block128   # vLLM's 128-token KV blocks vs echo2's 32

Each variant: start an engine on the default model, then 3 timed batches of the demo's shape
(4 prompts x G=8 samples, 16 new tokens, temperature 1), then one hot reload of the same weights.
Prints start-up seconds, median tokens/s, reload seconds and the ratios echo2-setting / baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

VARIANTS = {
    "echo2": {"enforce_eager": True, "dtype": "auto", "block_size": 32},
    "compiled": {"enforce_eager": False, "dtype": "auto", "block_size": 32},
    "bf16": {"enforce_eager": True, "dtype": "bfloat16", "block_size": 32},
    "block128": {"enforce_eager": True, "dtype": "auto", "block_size": 128},  # vLLM's CPU default
}


def child(variant: str) -> None:
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from echo2cli.hardware import compute_dtype, has_cuda
    from echo2cli.models import prepare_default_model
    from echo2cli.tasks import chat, encode_chat

    settings = VARIANTS[variant]
    model = prepare_default_model()
    dtype = compute_dtype(has_cuda()) if settings["dtype"] == "auto" else settings["dtype"]
    t0 = time.perf_counter()
    llm = LLM(
        model=str(model),
        dtype=dtype,
        max_model_len=1024,
        kv_cache_memory_bytes=1 << 30,
        enforce_eager=settings["enforce_eager"],
        block_size=settings["block_size"],
        seed=0,
    )
    start_s = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(model)
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=8, temperature=1.0, max_tokens=16, logprobs=0, seed=0)
    rates = []
    for batch in range(3):  # new prompts each batch, as in training: nothing cached from the one before
        prompts = [
            encode_chat(tok, chat(f"Compute {a} + {a + 3}. Reply with only the number."))
            for a in range(4 * batch, 4 * batch + 4)
        ]
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        n = sum(len(c.token_ids) for o in outs for c in o.outputs)
        rates.append(n / (time.perf_counter() - t0))
    t0 = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model)})
    reload_s = time.perf_counter() - t0
    print(
        "RESULT "
        + json.dumps(
            {
                "variant": variant,
                "dtype": dtype,
                "start_s": start_s,
                "tokens_per_s": statistics.median(rates),
                "reload_s": reload_s,
            }
        ),
        flush=True,
    )


def run_variant(variant: str) -> dict:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0")}
    proc = subprocess.run([sys.executable, __file__, "--child", variant], capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--baseline", choices=["compiled", "bf16", "block128"], default="compiled")
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    ours, base = run_variant("echo2"), run_variant(args.baseline)
    for r in (ours, base):
        print(
            f"{r['variant']:9s} dtype {r['dtype']:9s} start {r['start_s']:6.1f} s  "
            f"{r['tokens_per_s']:6.1f} tok/s  reload {r['reload_s']:.2f} s"
        )
    print(
        f"start-up ratio echo2/{args.baseline}: {ours['start_s'] / base['start_s']:.2f}x; "
        f"tokens/s ratio: {ours['tokens_per_s'] / base['tokens_per_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
