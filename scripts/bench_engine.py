"""vLLM engine on this host: start-up time and rollout tokens/s for the engine settings echo2 uses
(eager, fp32 on a CPU without bf16) against a baseline setting, each in a fresh process, same run.

    .venv/bin/python scripts/bench_engine.py --baseline compiled   # torch.compile warm-up vs eager
    .venv/bin/python scripts/bench_engine.py --baseline bf16       # emulated bf16 vs fp32 (CPU without bf16)
    .venv/bin/python scripts/bench_engine.py --baseline block128   # vLLM's 128-token KV blocks vs echo2's 32
    .venv/bin/python scripts/bench_engine.py --baseline processes  # vLLM's engine processes vs one process
    .venv/bin/python scripts/bench_engine.py --baseline processes --one-core   # the same, each on core 0 alone

Each variant: start an engine on the default model, then 5 timed batches of the demo's shape
(4 prompts x G=8 samples, 16 new tokens, temperature 1), then one hot reload of the same weights.
Prints start-up seconds (from the LLM call, and from the process's start, imports included), median tokens/s,
reload seconds and the ratios echo2-setting / baseline. The model runs on core 0 (VLLM_CPU_OMP_THREADS_BIND);
`--one-core` confines the whole process, and any it starts, to core 0: the other cores as busy as in the one-box
demo, where the learner and the other worker use them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

T0 = time.perf_counter()  # the child's start, before vLLM's and torch's imports

ECHO2 = {"enforce_eager": True, "dtype": "auto", "block_size": 32, "in_process": True}
VARIANTS = {
    "echo2": ECHO2,
    "compiled": {**ECHO2, "enforce_eager": False},
    "bf16": {**ECHO2, "dtype": "bfloat16"},
    "block128": {**ECHO2, "block_size": 128},  # vLLM's CPU default
    "processes": {**ECHO2, "in_process": False},  # vLLM's default: engine core, model runner in processes of their own
}


def child(variant: str) -> None:
    settings = VARIANTS[variant]
    if settings["in_process"]:  # as a worker's engine (echo2cli/worker/engine.py)
        from echo2cli.hardware import has_cuda
        from echo2cli.worker.engine import prepare_in_process

        prepare_in_process(asked=True, cuda=has_cuda())
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from echo2cli.hardware import compute_dtype, has_cuda
    from echo2cli.models import prepare_default_model
    from echo2cli.tasks import chat, encode_chat

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
    ready_s = time.perf_counter() - T0
    tok = AutoTokenizer.from_pretrained(model)
    from vllm.inputs import TokensPrompt

    params = SamplingParams(n=8, temperature=1.0, max_tokens=16, logprobs=0, seed=0)
    rates = []
    for batch in range(5):  # new prompts each batch, as in training: nothing cached from the one before
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
                "ready_s": ready_s,
                "tokens_per_s": statistics.median(rates),
                "reload_s": reload_s,
            }
        ),
        flush=True,
    )


def run_variant(variant: str, one_core: bool) -> dict:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0")}
    proc = subprocess.run(
        [sys.executable, __file__, "--child", variant],
        capture_output=True,
        text=True,
        env=env,
        preexec_fn=(lambda: os.sched_setaffinity(0, {0})) if one_core else None,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child")
    ap.add_argument("--baseline", choices=[v for v in VARIANTS if v != "echo2"], default="compiled")
    ap.add_argument("--one-core", action="store_true", help="confine each variant's processes to core 0")
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    ours, base = run_variant("echo2", args.one_core), run_variant(args.baseline, args.one_core)
    for r in (ours, base):
        print(
            f"{r['variant']:9s} dtype {r['dtype']:9s} start {r['start_s']:6.1f} s (ready {r['ready_s']:5.1f} s "
            f"after process start)  {r['tokens_per_s']:6.1f} tok/s  reload {r['reload_s']:.2f} s"
        )
    print(
        f"start-up ratio echo2/{args.baseline}: {ours['start_s'] / base['start_s']:.2f}x "
        f"(from process start {ours['ready_s'] / base['ready_s']:.2f}x); "
        f"tokens/s ratio: {ours['tokens_per_s'] / base['tokens_per_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
