"""The worker's vLLM arguments: the CPU path keeps its measured settings, a GPU host takes its flags."""

import os
from pathlib import Path

from echo2cli.config import WorkerConfig
from echo2cli.worker.engine import GpuSettings, cpu_list, engine_kwargs, instance_dict


def kwargs(cuda: bool, gpu: GpuSettings = GpuSettings(), dtype: str = "auto", wire: str = "bf16") -> dict:
    return engine_kwargs(
        Path("/m"), cuda=cuda, dtype=dtype, max_model_len=16896, seed=3, kv_cache_gib=0.5, gpu=gpu, wire=wire
    )


def test_a_gpu_host_gets_bf16_its_memory_share_tensor_parallelism_and_batch():
    k = kwargs(True, GpuSettings(memory_utilization=0.9, tensor_parallel_size=2, max_num_seqs=64))
    assert k["dtype"] == "bfloat16" and k["max_model_len"] == 16896 and not k["enforce_eager"]
    assert (k["gpu_memory_utilization"], k["tensor_parallel_size"], k["max_num_seqs"]) == (0.9, 2, 64)
    assert "kv_cache_memory_bytes" not in k and "block_size" not in k
    assert "max_num_seqs" not in kwargs(True)  # 0: vLLM's own default


def test_an_engine_never_rounds_fp16_versions_to_bf16(monkeypatch):
    """A run publishing fp16 (`--wire-dtype`): a GPU engine computes in fp16, a CPU one in fp32 even where the CPU
    has bf16; an asked dtype stands."""
    from echo2cli import hardware

    assert kwargs(True, wire="fp16")["dtype"] == "float16"
    assert kwargs(True, wire="fp16", dtype="bfloat16")["dtype"] == "bfloat16"
    for has_bf16, bf16_wire in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(hardware, "cpu_has_bf16", lambda has=has_bf16: has)
        assert kwargs(False, wire="fp16")["dtype"] == "float32"
        assert kwargs(False)["dtype"] == bf16_wire


def test_the_cpu_path_keeps_its_measured_settings_whatever_the_gpu_flags():
    k = kwargs(False, GpuSettings(memory_utilization=0.9, tensor_parallel_size=2, max_num_seqs=64), dtype="float32")
    assert k["kv_cache_memory_bytes"] == 1 << 29 and k["block_size"] == 32 and k["enforce_eager"]
    assert k["dtype"] == "float32" and k["logprobs_mode"] == "processed_logprobs"
    assert not {"gpu_memory_utilization", "tensor_parallel_size", "max_num_seqs"} & k.keys()


def test_worker_flags_default_to_the_settings_before_they_existed():
    cfg = WorkerConfig(join="http://learner")
    assert GpuSettings(cfg.gpu_memory_utilization, cfg.tensor_parallel_size, cfg.max_num_seqs) == GpuSettings()


def test_an_in_process_engine_reads_the_cpu_lists_of_one_engine_and_nothing_else():
    assert cpu_list("0") == {0} and cpu_list("0,1") == {0, 1} and cpu_list("0-3,6") == {0, 1, 2, 3, 6}
    assert cpu_list(" 2 , 4-5") == {2, 4, 5}
    for other in ("", "auto", "nobind", "0-1|2-3", "a", "1-", "-1", "0,,1"):
        assert cpu_list(other) == set(), other


class AnswersEverything:
    """Like llvmlite's library wrapper (loaded with numba): every attribute, `__dict__` too, is a function."""

    __slots__ = ()

    def __getattr__(self, name: str) -> object:
        return lambda: None


def test_the_kernel_scan_of_an_in_process_engine_gets_a_mapping_for_any_object():
    class Plain:
        def __init__(self) -> None:
            self.kernel = 1

    assert instance_dict(Plain()) == {"kernel": 1}
    assert instance_dict(AnswersEverything()) == {}  # vLLM's scan called .get on it and failed
    assert instance_dict(Plain)["__init__"] is Plain.__init__  # a class's mappingproxy stands


def test_an_engine_runs_in_process_on_cpu_when_asked_or_when_the_user_says_so_and_never_against_the_user(
    monkeypatch,
):
    from echo2cli.worker import engine

    prepared: list[str] = []
    monkeypatch.setattr(engine, "pin_model_threads", prepared.append)  # it would pin this test's own thread
    monkeypatch.setattr(engine, "tolerate_foreign_dicts", lambda: None)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    monkeypatch.delenv(engine.MULTIPROCESSING_ENV, raising=False)
    assert not engine.prepare_in_process(asked=True, cuda=True) and engine.MULTIPROCESSING_ENV not in os.environ
    assert not engine.prepare_in_process(asked=False, cuda=False) and not prepared
    assert engine.prepare_in_process(asked=True, cuda=False) and os.environ[engine.MULTIPROCESSING_ENV] == "0"
    assert prepared == ["1"]
    assert engine.prepare_in_process(asked=False, cuda=False)  # vLLM would run it in-process all the same
    monkeypatch.setenv(engine.MULTIPROCESSING_ENV, "1")
    assert not engine.prepare_in_process(asked=True, cuda=False) and prepared == ["1", "1"]
