"""The trainer sharded across processes with FSDP2 (`torch.distributed.fsdp.fully_shard`), under torchrun.

Every rank holds 1/N of the fp32 parameters, gradients and AdamW state. Each decoder layer is one FSDP unit
(all-gathered for its forward and backward, then freed); the root unit holds the embeddings, the final norm and
the head. Where the hardware has bf16 the layers compute in it (FSDP2's MixedPrecisionPolicy: each layer's fp32
shards all-gathered as bf16, gradients reduced in fp32), the root unit in fp32, so master weights, gradients, their
reduction and the vocabulary head's logits stay fp32. A micro-batch is packed as in one process (`packing.py`):
one pass through the layers whatever its rows, so every rank makes the same collectives.

Start-up (`shard_load.py`): each rank builds the model on the meta device, shards it there and reads only its own
rows of each tensor from the memory-mapped safetensors files, so no rank ever holds the whole model; the KL
reference is built the same way, in bf16 where the layers compute in bf16. A model handed in whole (the
benchmarks build theirs from a config) is sharded as it is.

Rank 0 is the learner: coordinator, API, tracker and publisher run there alone. The other ranks only train:
`follow()` waits for rank 0's next call (a step with its batch, an export, a checkpoint save or load) and
makes the same one, so the collectives of every rank line up. In a step the batch's sequences are split
across ranks by token count (`batching.balance`); each rank weighs its micro-batches by their share of the
whole batch's completion tokens, so the summed gradient is the one-process gradient. A rank with fewer
micro-batches than another makes zero-weighted passes to keep step.

Checkpoints: `torch.distributed.checkpoint` (each rank writes its shards to `dcp/`) plus rank 0's
HF export of the full fp32 weights, so `echo2 eval` reads a sharded run's checkpoint as any other.

How the ranks end:
1. A clean finish: rank 0 says STOP (`close`), each rank leaves its process group and the process (`leave`).
   A stop request is one: `echo2 learner --nproc-per-node N` runs torchrun as its child and hands the first
   SIGTERM or SIGINT to rank 0 alone (`cli._run_under_torchrun`), which stops at the step boundary as one process
   does; given to torchrun's agent, the signal would go to every rank, with SIGKILL 30 s later.
2. A failure on any rank (an exception in a step, a checkpoint, `follow`): that rank sends nothing more and its
   process exits at once with code 1 (`exit_failed_rank`, called by `cli.main`). The other ranks may be inside a
   collective of the call it left (an FSDP all-gather, the gradient norm's all-reduce): a STOP, or anything else,
   would not line up with it and every rank would wait for the process-group timeout. torchrun's agent (2.13)
   polls its ranks every 0.1 s; when one has exited non-zero it sends SIGTERM to the others (rank 0 takes it as a
   stop request, the others ignore it), waits up to 30 s and sends SIGKILL. Sooner than that, gloo fails a
   collective whose peer has gone ("Connection closed by peer"), so the others fail and exit in turn (measured on 2
   CPU ranks, tests/integration/test_sharded_failure.py: every rank gone within 0.3 s of the failure). A backend
   that does not notice (NCCL may not) leaves it to torchrun's SIGKILL.
3. Idle time: a rank > 0 waits for rank 0's next call in a collective, which fails after DIST_TIMEOUT_S (2 h).
   While rank 0 waits for rollouts (no workers yet, say) it makes a no-op call every KEEPALIVE_S (5 min;
   `keep_alive`, from the training thread like every other call, so every rank still makes the same collectives in
   the same order). ECHO2_DIST_TIMEOUT_S overrides the timeout (the tests make it seconds); the keepalive then comes
   every quarter of it, if sooner.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from echo2cli.broadcast.image import VersionImage
from echo2cli.errors import ConfigError
from echo2cli.learner.batching import balance
from echo2cli.learner.shard_load import is_meta, materialize, meta_model
from echo2cli.learner.trainer import TokenLogp, Trainer, restore_rng, save_rng

DCP_DIR = "dcp"  # in a checkpoint: the sharded weights and optimizer state
STOP = "stop"
KEEPALIVE = "keep_alive"

# The longest a rank waits in one collective. For a rank > 0 that includes the wait for rank 0's next call, so it
# must outlast the longest time rank 0 is busy between calls (a step, a publish, a checkpoint, the final evaluation).
DIST_TIMEOUT_S = 2 * 3600.0
# An idle rank 0 makes a no-op call this often (or every quarter of the timeout, if sooner): the others' wait starts
# again long before it times out, for a few pickled bytes.
KEEPALIVE_S = 300.0
TIMEOUT_ENV = "ECHO2_DIST_TIMEOUT_S"  # overrides DIST_TIMEOUT_S (the tests make it seconds)


def world() -> tuple[int, int]:
    """(rank, world size) as torchrun set them; (0, 1) in a plain process."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or world()[1] > 1


def die_with_parent() -> None:
    """torchrun starts each rank in a session of its own: a torchrun killed with SIGKILL would leave them running
    (rank 0 still serving the API). Linux delivers SIGKILL to a rank whose parent dies (PR_SET_PDEATHSIG). Also
    the torchrun child of `echo2 learner --nproc-per-node N` (`cli._run_under_torchrun`), before it starts."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the call
        os._exit(1)


def leave(code: int) -> NoReturn:
    """End a torchrun rank without interpreter finalization. Gloo destroys a finished collective's work on its
    own thread, and that can take the GIL while the interpreter is being torn down: the rank then aborts
    ("terminate called without an active exception", SIGABRT) after all its work is done. Measured with
    tests/dist/sharded_step.py on 2 ranks: 3 runs in 30 aborted so, with destroy_process_group called first;
    none of 40 ending here did."""
    import logging
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def dist_timeout_s() -> float:
    """DIST_TIMEOUT_S, or the seconds in ECHO2_DIST_TIMEOUT_S."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DIST_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r}: give the process-group timeout in seconds (> 0), or unset it")
    return seconds


def exit_failed_rank() -> None:
    """Under torchrun, while handling an exception: print it and end this rank now, with code 1, without a
    collective and without interpreter finalization (module docstring, 2). In a plain process: nothing (the caller
    re-raises)."""
    import sys

    exc_type, exc, tb = sys.exc_info()
    if not under_torchrun() or exc_type is None or exc is None:
        return
    sys.excepthook(exc_type, exc, tb)  # as if uncaught: the same traceback, through typer's hook under `echo2`
    leave(1)


@contextlib.contextmanager
def closed_on_success(trainer: Trainer) -> Iterator[Trainer]:
    """`trainer.close()` when the block ends without an exception, and only then: a sharded trainer's rank 0 then
    tells the other ranks STOP, which after an exception would not line up with the collective they may be in."""
    yield trainer
    trainer.close()


def init_process_group() -> torch.device:
    """NCCL on CUDA (one GPU per local rank), gloo on CPU; returns this rank's device. A rank killed by a fatal
    signal (glibc's SIGABRT on a corrupt heap, a SIGSEGV in a backend) first prints each thread's Python stack to
    its stderr, which torchrun passes on: where it was is all a one-off crash in CI leaves behind."""
    import faulthandler

    faulthandler.enable(all_threads=True)
    die_with_parent()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timedelta(seconds=dist_timeout_s()))
    return device


class ShardedTrainer(Trainer):
    def __init__(self, model_dir: Path, **kwargs: Any) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        device = init_process_group()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        super().__init__(model_dir, device=device, **kwargs)
        # the optimizer on the sharded parameters: each rank keeps AdamW state for its shards only
        lr = self.opt.param_groups[0]["lr"]
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
        self.keepalive_s = min(KEEPALIVE_S, dist_timeout_s() / 4)
        self._told_at = time.monotonic()

    # -- the models, sharded from the start (`shard_load.py`) ------------------------------------------

    def _policy_model(self, model_dir: Path, model: torch.nn.Module | None) -> torch.nn.Module:
        """From a directory: on the meta device, allocated and loaded shard by shard in `_placed`. A model handed
        in whole (the benchmarks build theirs from a config) is sharded as it is."""
        return super()._policy_model(model_dir, model) if model is not None else meta_model(model_dir, torch.float32)

    def _reference_model(self, model_dir: Path) -> torch.nn.Module:
        if not is_meta(self.model):
            return super()._reference_model(model_dir)
        return meta_model(model_dir, torch.bfloat16 if self.autocast else torch.float32).eval().requires_grad_(False)

    def _placed(self, scorer: TokenLogp, model_dir: Path) -> TokenLogp:
        """Each decoder layer one FSDP2 unit, the scorer (embeddings, final norm, head) the root. Layers compute in
        bf16 where the hardware has it: FSDP2 all-gathers each layer's fp32 shards as bf16 and reduces gradients
        in fp32. The root stays fp32, for the head's fp32 logits (`TokenLogp`)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        layers = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.autocast else None
        for layer in scorer.model.get_decoder().layers:
            fully_shard(layer, mesh=self.mesh, **({"mp_policy": layers} if layers else {}))
        fully_shard(scorer, mesh=self.mesh)
        if is_meta(scorer):
            materialize(scorer, scorer.model, model_dir, self.device)
        return scorer

    # -- rank 0 calls, every other rank follows -------------------------------------------------------

    def _tell(self, call: str, *args: Any) -> None:
        if self.rank == 0:
            dist.broadcast_object_list([call, args], src=0)
            self._told_at = time.monotonic()

    def keep_alive(self) -> None:
        """Rank 0, while idle: a no-op call if the last call was `keepalive_s` ago, so the other ranks' wait for the
        next one does not reach the process-group timeout. Cheap enough to call on every poll."""
        if time.monotonic() - self._told_at >= self.keepalive_s:
            self._tell(KEEPALIVE)

    def follow(self) -> None:
        """On ranks > 0: make each call rank 0 makes, until it says stop. An exception (this rank's own, or a
        collective failing because another rank has gone) propagates: the process should then end at once
        (`exit_failed_rank`)."""
        while True:
            message: list[Any] = [None, None]
            dist.broadcast_object_list(message, src=0)
            call, args = message
            if call == STOP:
                self.close()
                return
            if call != KEEPALIVE:
                getattr(Trainer, call)(self, *args)

    def close(self) -> None:
        """At a clean finish only (`closed_on_success`): rank 0 releases the other ranks (they return from
        `follow`); every rank then leaves its process group. The process should end with `leave` (see there)."""
        if not dist.is_initialized():
            return
        if self.rank == 0:
            self._tell(STOP)
        dist.destroy_process_group()

    def step(self, groups: list, version: int | None = None) -> dict[str, Any]:
        self._tell("step", groups, version)
        return super().step(groups, version)

    def published_weights(self) -> dict[str, torch.Tensor] | None:
        self._tell("published_weights")
        return super().published_weights()

    def weights_image(self, reuse: VersionImage | None = None) -> VersionImage | None:
        """Rank 0: the gathered weights in the wire dtype as a file image (the other ranks join the gather)."""
        tensors = self.published_weights()
        return None if tensors is None else VersionImage(tensors, reuse, self.wire_dtype)

    def save_checkpoint(self, directory: Path) -> None:
        self._tell("save_checkpoint", directory)
        super().save_checkpoint(directory)

    def load_checkpoint(self, directory: Path) -> None:
        self._tell("load_checkpoint", directory)
        super().load_checkpoint(directory)

    # -- the sharded step --------------------------------------------------------------------------

    def _my_rows(self, lengths: list[int]) -> list[int]:
        return balance(lengths, self.world)[self.rank]

    def _micro_batch_count(self, mine: int) -> int:
        n = torch.tensor([mine], device=self.device)  # NCCL takes only tensors on the rank's GPU; gloo any
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        return int(n.item())

    def _loss_scale(self) -> float:
        return float(self.world)  # FSDP averages gradients over ranks; each rank's loss is a part of one sum

    def _reduce_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        parts: list[dict[str, float]] = [{}] * self.world
        dist.all_gather_object(parts, sums)
        out: dict[str, float] = {}
        for part in parts:
            for k, v in part.items():
                out[k] = max(out.get(k, v), v) if k.endswith("_max") else out.get(k, 0.0) + v
        return out

    def _gather(self, outliers: list[dict[str, Any]]) -> list[dict[str, Any]]:
        parts: list[list[dict[str, Any]]] = [[]] * self.world
        dist.all_gather_object(parts, outliers)
        return [o for part in parts for o in part]

    def _clip_grad_norm(self) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    # -- whole weights and checkpoints -------------------------------------------------------------------

    def _gathered(self, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        """The full weights on rank 0, gathered one tensor at a time (never a second full copy in memory)."""
        out: dict[str, torch.Tensor] = {}
        for name, value in self.model.state_dict().items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            if self.rank == 0:
                out[name] = full.detach().to("cpu", dtype).contiguous()
            del full
        return out if self.rank == 0 else None

    def _full_state(self) -> dict[str, torch.Tensor] | None:
        return self._gathered(self.wire_dtype)

    def _save(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from echo2cli.layout import WEIGHTS_FILE

        model_state, optim_state = get_state_dict(self.model, self.opt)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory / DCP_DIR))
        full = self._gathered(torch.float32)
        if full is not None:  # rank 0: the HF export that eval and a plain learner read
            if getattr(self.model.config, "tie_word_embeddings", False):
                full.pop("lm_head.weight", None)
            save_file(full, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
            self.model.config.save_pretrained(directory)
            if getattr(self.model, "generation_config", None) is not None:
                self.model.generation_config.save_pretrained(directory)
            save_rng(directory / "rng.pt", cuda=False)

    def _load(self, directory: Path) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        if not (directory / DCP_DIR).is_dir():
            raise ValueError(f"{directory} has no {DCP_DIR}/: it was not written by a sharded learner")
        model_state, optim_state = get_state_dict(self.model, self.opt)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(directory / DCP_DIR))
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        restore_rng(directory / "rng.pt")
