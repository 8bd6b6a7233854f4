"""Methods vLLM mixes into its model-runner worker (`worker_extension_cls`), for `collective_rpc` to call by name.

`reload_weights` alone leaves a CPU engine's tied LM head on the weights it started with. On CPU, vLLM packs
each linear layer's weight for its GEMM kernel once, after loading (`dispatch_cpu_unquantized_gemm`: a oneDNN
handle, or a packed copy), and computes with the packed copy. An in-place reload re-packs every layer it loads
weights for. A tied head (SmolLM2, Qwen3 up to 4B, Llama 3.2: `tie_word_embeddings`) loads none of its own, since
its weight is the embedding's. So the reload puts its old tensor back and keeps its old packed copy. The engine
then takes the new weights' hidden states through the first version's head. Measured (docs/BENCHMARKS.md): a
hot-swapped engine was 0.25 nats off the trainer on tokens where a fresh engine on the same file agreed to 1e-5,
and after an lr 2e-4 step 14-17 nats off on the end-of-answer token.

`repack_unloaded_heads` packs the LM head again from its current weight: 0.14 s a swap for the default model, beside
0.85 s for the reload (docs/BENCHMARKS.md). The embedding's packed copy is left alone, since nothing computes with
it. A linear layer drops its weight once packed, and the reload re-packs it anyway. GPU engines multiply by the weight
itself, so there is nothing to refresh.
"""

from __future__ import annotations

from typing import Any


class EngineWeights:
    model_runner: Any  # the vLLM worker's

    def repack_unloaded_heads(self) -> int:
        """Re-run the CPU GEMM dispatch of every LM head that packed a copy of its weight; how many."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        count = 0
        for module in self.model_runner.get_model().modules():
            if isinstance(module, ParallelLMHead) and hasattr(module, "cpu_linear") and module.weight.numel():
                dispatch_cpu_unquantized_gemm(module, remove_weight=False)
                count += 1
        return count
