"""The vLLM engine a worker generates with, and its in-place weight hot swap.

`reload` calls vLLM's `reload_weights` through `collective_rpc` on a directory holding only
`model.safetensors`: the engine keeps its KV cache and process, so a swap costs about a second for the
135M default on a 2-core CPU instead of an engine restart (docs/BENCHMARKS.md has the figures).

Weights travel in bf16 or fp16 (the learner's `--wire-dtype`); the engine computes in bf16 where the hardware
has it (CUDA, or a CPU with AVX512-BF16/AMX) and in fp32 elsewhere, where emulated bf16 measured 3x slower; with
fp16 versions, in fp16 on CUDA and fp32 on any CPU (`hardware.engine_dtype`). It returns the
log-prob of every sampled token (`SamplingParams(logprobs=0)`) under the distribution it was sampled
from: `logprobs_mode="processed_logprobs"` gives log softmax(z / T) (vLLM's default, raw log-probs, is
log softmax(z) whatever T is), and `generation_config="vllm"` keeps a model's generation_config.json from
adding top-k/top-p truncation the trainer would not know about. The trainer scores with z / T too, so
the importance weights compare the same two distributions at any temperature.
On CPU the KV cache is sized in bytes (`kv_cache_memory_bytes`) because the GPU-style memory fraction
fails there. vLLM is imported lazily: nothing else in echo2 needs it.

In a LoRA run (`echo2cli/lora.py`) the engine runs the base with LoRA enabled, and `load_adapter` swaps in a
version's adapters instead of weights: vLLM loads them as the adapter named `v<version>` (it keeps the last few
in memory), and every later generate uses it. The adapter's name is in vLLM's prefix-cache keys, so the cache
needs no reset.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from echo2cli.errors import ModelError
from echo2cli.hardware import engine_dtype, has_cuda
from echo2cli.lora import vllm_rank
from echo2cli.protocol import LoraSpec
from echo2cli.worker.reaper import start_reaper
from echo2cli.worker.vllm_plugin import BUSY_LOOP_ENV, STORE_DIR_ENV

# vLLM's switch between an engine in processes of its own (its default, "1") and one in the creating process ("0")
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"

# How long vLLM's model-runner process busy-waits for the next message before it sleeps (vLLM's own: 1 s).
# Decode steps come a few ms apart, so generation keeps the fast path; an engine between leases or on standby
# stops burning a core 50 ms after its last message (vllm_plugin.py; docs/BENCHMARKS.md "Idle engines").
ENGINE_BUSY_LOOP_S = 0.05


def socket_dir() -> None:
    """Give vLLM's ZMQ sockets (files it names in VLLM_RPC_BASE_PATH, default /tmp, and never removes) and its
    executors' FileStore (vllm_plugin.py) one directory per process, removed when the process exits. Set once, so
    every engine of the process (and the processes each spawns) agrees on it even where vLLM caches its
    environment."""
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        path = tempfile.mkdtemp(prefix="echo2-vllm-")
        os.environ["VLLM_RPC_BASE_PATH"] = path
        os.environ.setdefault(STORE_DIR_ENV, path)
        atexit.register(shutil.rmtree, path, ignore_errors=True)


def cpu_list(spec: str) -> set[int]:
    """The CPUs of a list such as "0", "0,1" or "0-3,6" (VLLM_CPU_OMP_THREADS_BIND's form for one engine); empty
    for anything else ("auto", "nobind", one list per rank joined by "|")."""
    cpus: set[int] = set()
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            return set()
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def pin_model_threads(spec: str) -> None:
    """An engine in this process runs its model on the calling thread, and vLLM's CPU executor binds OpenMP only
    in the processes it spawns: give the model the CPUs `spec` names (VLLM_CPU_OMP_THREADS_BIND), one torch
    thread each, and pin this thread to them (threads it starts later inherit that). Anything but a list leaves
    torch's default."""
    cpus = cpu_list(spec)
    if not cpus:
        return
    import torch

    torch.set_num_threads(len(cpus))  # before vLLM's CPU worker replaces set_num_threads with a no-op
    os.sched_setaffinity(0, cpus)


def instance_dict(obj: Any) -> Any:
    """`vars(obj)`, or an empty dict where that is not a mapping: llvmlite's library wrapper (numba's, which the
    delta kernels load) answers every attribute, `__dict__` included, with a function wrapper."""
    found = vars(obj)
    return found if hasattr(found, "get") else {}


def tolerate_foreign_dicts() -> None:
    """vLLM's CPU worker rebinds kernels by scanning every module's globals and reading `vars(value).get(...)` of
    each; in a process that has loaded numba that read fails ("'_lib_fn_wrapper' object has no attribute 'get'").
    vLLM's own processes never load numba; an engine in this process does, so its scan gets a `vars` that
    tolerates the wrapper."""
    try:
        from vllm.triton_utils import dispatcher
    except ImportError:  # another vLLM version: leave it as it is
        return
    dispatcher.vars = instance_dict  # the module's global shadows the builtin


def prepare_in_process(asked: bool, cuda: bool) -> bool:
    """Whether vLLM will run the next engine in this process (CPU only: asked for here, or by the user's
    VLLM_ENABLE_V1_MULTIPROCESSING=0; =1 keeps vLLM's processes); if so, its threads pinned and its kernel scan
    made safe. vLLM reads the switch when LLM() builds the engine: its environment is not cached before the first
    engine core starts."""
    if cuda:
        return False
    if asked:
        os.environ.setdefault(MULTIPROCESSING_ENV, "0")
    if os.environ.get(MULTIPROCESSING_ENV) != "0":
        return False
    pin_model_threads(os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""))
    tolerate_foreign_dicts()
    return True


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class GpuSettings:
    """vLLM's settings on a GPU host (ignored on CPU, where the KV cache is sized in bytes)."""

    memory_utilization: float = 0.5  # fraction of GPU memory for weights, activations and KV cache
    tensor_parallel_size: int = 1  # GPUs one engine spreads each layer over
    max_num_seqs: int = 0  # sequences generated at once (0 = vLLM's default)


def engine_kwargs(
    model_dir: Path,
    *,
    cuda: bool,
    dtype: str,
    max_model_len: int,
    seed: int,
    kv_cache_gib: float,
    gpu: GpuSettings,
    lora: LoraSpec | None = None,
    adapters_kept: int = 1,
    wire: str = "bf16",
) -> dict:
    """The arguments of `vllm.LLM` for one worker's engine; with `lora`, room for `adapters_kept` adapters.
    `wire`: the dtype the run's versions travel in (`hardware.engine_dtype`)."""
    kwargs: dict = dict(
        model=str(model_dir),
        dtype=engine_dtype(cuda, wire) if dtype == "auto" else dtype,
        max_model_len=max_model_len,
        seed=seed,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",  # the log-probs of softmax(z / T), which the token came from
        generation_config="vllm",  # no top-k/top-p from the model's generation_config.json
        # On CPU, torch.compile warm-up takes 96-126 s per engine start against 4 s eager, for
        # ~15 % more tokens/s (docs/BENCHMARKS.md): eager is the better trade for workers that join.
        enforce_eager=not cuda,
        worker_extension_cls="echo2cli.worker.vllm_ext.EngineWeights",  # collective_rpc("repack_unloaded_heads")
    )
    if lora is not None:
        kwargs.update(enable_lora=True, max_lora_rank=vllm_rank(lora.rank), max_loras=1, max_cpu_loras=adapters_kept)
    if not cuda:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_gib * (1 << 30))
        # vLLM's CPU default of 128-token blocks leaves prompts shorter than that out of the prefix
        # cache, so each of a prompt's n samples and every shared system prompt is prefilled again;
        # 32-token blocks made a 200-problem eval 1.6x faster (docs/BENCHMARKS.md).
        kwargs["block_size"] = 32
        return kwargs
    kwargs["gpu_memory_utilization"] = gpu.memory_utilization
    kwargs["tensor_parallel_size"] = gpu.tensor_parallel_size
    if gpu.max_num_seqs:
        kwargs["max_num_seqs"] = gpu.max_num_seqs
    return kwargs


class Engine:
    def __init__(
        self,
        model_dir: Path,
        *,
        kv_cache_gib: float = 1.0,
        max_model_len: int = 1024,
        seed: int = 0,
        dtype: str = "auto",
        all_cpus: bool = False,
        gpu: GpuSettings = GpuSettings(),
        lora: LoraSpec | None = None,
        adapters_kept: int = 1,
        in_process: bool = False,
        wire: str = "bf16",
    ) -> None:
        """`lora`: versions after the first are adapters of this spec (`load_adapter`), `adapters_kept` of them
        held by vLLM at once. `all_cpus` (CPU only): run the model on every CPU this process may use. vLLM's
        default keeps one for its scheduler process, which on 2 cores halves the model's share; an engine that has
        the machine to itself (`echo2 eval`) is ~1.5x faster with both (docs/BENCHMARKS.md).

        `in_process` (CPU only; VLLM_ENABLE_V1_MULTIPROCESSING=1 overrides it, =0 implies it): run vLLM's engine
        core and model runner in this process, not in two of their own that each import vLLM and torch again. The
        engine starts sooner and there is no engine process to outlive this one (docs/BENCHMARKS.md, "The CPU
        engine in the worker's process"). One such engine per process: vLLM then caches its environment, seeds
        this process's random generators and disables `torch.set_num_threads` here."""
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ModelError(f"vLLM is not importable ({exc}): run `bash scripts/setup.sh`") from exc
        cuda = has_cuda()
        self.max_model_len = max_model_len
        kwargs = engine_kwargs(
            model_dir,
            cuda=cuda,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            kv_cache_gib=kv_cache_gib,
            gpu=gpu,
            lora=lora,
            adapters_kept=adapters_kept,
            wire=wire,
        )
        self.adapter: Any = None  # the LoRARequest every generate uses (None: the weights alone)
        if not cuda and all_cpus and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            # read by the engine process vLLM spawns, which inherits this environment
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(os.sched_getaffinity(0))))
        in_process = prepare_in_process(in_process, cuda)
        # vLLM's engine processes do not die with this one: a watchdog kills them if we are killed (reaper.py)
        self._reaper = None if in_process else start_reaper()
        if not cuda:  # read by vllm_plugin.py in the processes vLLM starts: idle engines do not spin
            os.environ.setdefault(BUSY_LOOP_ENV, str(ENGINE_BUSY_LOOP_S))
        socket_dir()
        try:
            self.llm = LLM(**kwargs)
        except Exception as exc:  # vLLM raises many types; all mean "this model does not start"
            self._stop_reaper()
            raise ModelError(f"vLLM could not start on {model_dir}: {exc}") from exc

    def generate(
        self,
        prompts: list[list[int]],
        *,
        n: int | Sequence[int],
        temperature: float | Sequence[float],
        max_new_tokens: int,
    ) -> list[list[Completion]]:
        """n completions per prompt, each with per-token behaviour log-probs; none for a prompt the engine
        cannot take (at least max_model_len tokens: vLLM would fail the whole call on it).

        `n` and `temperature` are one value for all prompts or one per prompt: a single call with mixed
        requests (greedy and sampled, say) batches them together and shares their cached prompt prefill.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ns = [n] * len(prompts) if isinstance(n, int) else list(n)
        temps = [temperature] * len(prompts) if isinstance(temperature, int | float) else list(temperature)
        if len(ns) != len(prompts) or len(temps) != len(prompts):
            raise ValueError("n and temperature need one value per prompt")
        # No per-request seed: vLLM's CPU sampler rejects it ("CPU Generator does not use offset");
        # the engine-wide seed makes runs reproducible instead.
        cache: dict[tuple[int, float], SamplingParams] = {}
        params = [
            cache.setdefault((k, t), SamplingParams(n=k, temperature=t, max_tokens=max_new_tokens, logprobs=0))
            for k, t in zip(ns, temps, strict=True)
        ]
        ok = [i for i, p in enumerate(prompts) if 0 < len(p) < self.max_model_len]
        if not ok:
            return [[] for _ in prompts]
        try:
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=prompts[i]) for i in ok],
                [params[i] for i in ok],
                use_tqdm=False,
                lora_request=self.adapter,
            )
        except Exception as exc:  # EngineDeadError and friends: the engine process is gone
            raise ModelError(f"the vLLM engine failed while generating: {exc}") from exc
        groups: list[list[Completion]] = [[] for _ in prompts]
        for i, out in zip(ok, outputs, strict=True):
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = [step[tok].logprob for step, tok in zip(c.logprobs or [], ids, strict=True)]
                groups[i].append(Completion(ids, lps, c.finish_reason or ""))
        return groups

    def reload(self, weights_dir: Path) -> float:
        """Swap in the weights of `weights_dir/model.safetensors`; returns seconds taken. On CPU the layers whose
        packed copy the reload leaves stale (a tied LM head) are packed again (`vllm_ext.py`)."""
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(weights_dir)})
        self.llm.collective_rpc("repack_unloaded_heads")
        if not self.llm.reset_prefix_cache():  # cached KV of the old weights must not be reused
            raise ModelError(
                "vLLM refused to reset its prefix cache after a weight swap: the next prompts "
                "would reuse KV computed with the old weights"
            )
        return time.perf_counter() - t0

    def load_adapter(self, version: int, adapter_dir: Path) -> float:
        """Generate with the LoRA adapters in `adapter_dir` (`lora.adapter_dir`) from now on; returns seconds taken.
        They are loaded here, not at the next generate, so the swap's cost shows where it is paid."""
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        request = LoRARequest(f"v{version}", version + 1, str(adapter_dir))  # ids start at 1
        try:
            self.llm.llm_engine.add_lora(request)
        except Exception as exc:  # a malformed adapter file: vLLM raises ValueError, KeyError, RuntimeError...
            raise ModelError(f"vLLM could not load the adapters of version {version}: {exc}") from exc
        self.adapter = request
        return time.perf_counter() - t0

    def close(self) -> None:
        """Stop the engine's processes now (left to vLLM's exit hook, they take a 5 s grace period)."""
        try:
            self.llm.llm_engine.engine_core.shutdown(timeout=1.0)
        except Exception:  # best effort: the process exits soon anyway
            pass
        self._stop_reaper()

    def _stop_reaper(self) -> None:
        if self._reaper is not None:
            self._reaper.terminate()
            self._reaper.wait(timeout=5)
            self._reaper = None
