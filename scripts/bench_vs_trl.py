"""echo2 against Hugging Face TRL's GRPOTrainer on one machine, on the same GRPO problem.

Both sides: the default model (SmolLM2-135M-Instruct), the arithmetic task's train prompts in the same order
(seed 0) and its reward function, B = 4 prompts x G = 8 samples per step, 16-token completions at temperature
1, AdamW with betas (0.9, 0.99) and no weight decay, PPO clip 0.2, no KL term, a token-level mean loss
(TRL's `dapo`, echo2's DAPO mean), rewards scaled by the group's std, gradient norm clipped at 1, a constant
learning rate, one optimizer step per batch, and the same number of steps. Then `echo2 eval` scores each final
model on the same held-out problems, each as it sampled while training: echo2's checkpoint rounded to bf16 (what
its workers ran), TRL's fp32 weights. An engine computing in bf16 (a CPU with AVX512-BF16, a GPU) rounds TRL's
weights itself, which undoes most of what 20 small steps changed; compare TRL on a host computing in fp32.
echo2's every `--eval-every`-th version is scored too, for the wall time it took to reach TRL's final accuracy.

echo2's side is the default demo (`echo2 demo`: a learner and two local workers, S = 2, lr 2e-5). TRL's
side is its GRPOTrainer as a user runs it on a CPU box: one process, generation with transformers'
`generate` (TRL's vLLM modes need a GPU), synchronous. TRL is run at each learning rate of `--trl-lrs`
(its own default is 1e-6) so that it is compared at its best, not at echo2's; echo2 at each rate of
`--echo2-lrs` (the demo's default unless given), so that each side's rate can be chosen the same way.

    .venv/bin/pip install -e '.[bench]'         # TRL (not needed by echo2 itself)
    .venv/bin/python scripts/bench_vs_trl.py --trl-lrs 3e-6,1e-5,3e-5 --seeds 0,1 --out runs/vs-trl

`--echo2-runs OUT2` adds the runs of an `echo2 bench staleness` OUT as echo2 sides (the same prompts, batch and
evaluation; S = 0 with one worker is echo2 run synchronously, as TRL is):

    .venv/bin/echo2 bench staleness --staleness 0 --lr 1e-5 --eval-limit 200 --eval-every 4 --out runs/sync
    .venv/bin/python scripts/bench_vs_trl.py --skip-echo2 --trl-lrs 1e-5 --echo2-runs runs/sync --out runs/vs-trl

`--trl-lr-schedule linear|cosine` (with `--trl-lr-warmup-steps`, `--trl-lr-min-ratio`) gives TRL's steps the
rates echo2's learner takes under the same `--lr-schedule` options (`echo2cli/learner/schedule.py`, set before
each optimizer step), so that a scheduled echo2 run from `echo2 bench staleness` meets TRL on the same curve:

    .venv/bin/echo2 bench staleness --staleness 2 --lr 2e-5 --lr-schedule cosine --lr-min-ratio 0.1 ... --out runs/cos
    .venv/bin/python scripts/bench_vs_trl.py --skip-echo2 --trl-lrs 1e-5 --trl-lr-schedule cosine \
        --trl-lr-min-ratio 0.1 --echo2-runs runs/cos --out runs/vs-trl-cos

Rows go to OUT/rows.jsonl as each run finishes (a rerun skips finished ones, so more seeds or rates can be added
to the same OUT later); the tables are printed and OUT/vs_trl.png drawn at the end, over every seed there or the
ones `--report-seeds` names.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from echo2cli.bench.staleness import prune, schedule_spec
from echo2cli.config import DemoConfig
from echo2cli.learner.schedule import LrSchedule
from echo2cli.metrics import read_metrics

B, G, MAX_NEW_TOKENS, STEPS = 4, 8, 16, 20


def evaluate_raw(model_or_run: list[str], limit: int, k: int) -> dict[str, Any]:
    argv = [sys.executable, "-m", "echo2cli", "eval", *model_or_run, "--limit", str(limit), "--k", str(k), "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def evaluate(model_or_run: list[str], limit: int, k: int) -> dict[str, Any]:
    result = evaluate_raw(model_or_run, limit, k)
    return {k: result[k] for k in ("greedy_accuracy", "pass_at_k", "sampled_reward", "problems")}


def run_echo2(out: Path, seed: int, lr: float, steps: int, keep_every: int) -> dict[str, Any]:
    """The default demo at learning rate `lr`; wall time from its summary (learner start to the last step,
    workers included), and the wall time at which each version was trained: the demo's wall time less what came
    after that version, so the learner's start-up is counted in every version's time."""
    argv = [sys.executable, "-m", "echo2cli", "demo", "--out", str(out), "--steps", str(steps), "--seed", str(seed)]
    argv += ["--lr", f"{lr:g}"]
    argv += ["--keep-versions-every", str(keep_every)] if keep_every else []
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads((out / "demo_summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = rows[-1]["time_s"]
    return {
        "wall_s": summary["wall_s"],
        "reward": [r["rollout/reward_mean"] for r in rows],
        "time_s": [summary["wall_s"] - (last - r["time_s"]) for r in rows],  # step i's end, which is version i + 1
    }


def echo2_curve(out: Path, res: dict[str, Any], final: dict[str, Any], every: int, limit: int) -> list[dict]:
    """Held-out greedy accuracy of every `every`-th version before the last (one engine for all of them), then
    the final one's, each with the wall time it was trained at."""
    versions = list(range(every, res["steps"], every)) if every else []
    points = []
    if versions:
        first = evaluate_raw(["--run", str(out), "--version", ",".join(map(str, versions))], limit, 0)
        scored = [first, *first.get("then", [])]
        points = [{"version": r["version"], "greedy_accuracy": r["greedy_accuracy"]} for r in scored]
    points.append({"version": res["steps"], "greedy_accuracy": final["greedy_accuracy"]})
    return [{**p, "time_s": res["time_s"][p["version"] - 1]} for p in points]


def rounded_policy() -> Any:
    """A TRL callback that gives TRL echo2's numerics: the policy it samples from and scores is its fp32 weights
    rounded to bf16, as a version is published (and as a bf16 engine on a GPU holds it); the fp32 master is put
    back for each optimizer step (echo2cli/learner/rounding.py does the same in echo2's learner)."""
    from transformers import TrainerCallback

    class RoundedPolicy(TrainerCallback):
        def __init__(self) -> None:
            self.master: dict[str, Any] = {}

        def _round(self, model: Any) -> None:
            for name, p in model.named_parameters():
                self.master[name] = p.data.clone()
                p.data.copy_(p.data.bfloat16())

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            self._round(model)

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            for name, p in model.named_parameters():
                p.data.copy_(self.master[name])

        def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
            self._round(model)

    return RoundedPolicy()


def scheduled_rate(schedule: LrSchedule, applied: list[float]) -> Any:
    """A TrainerCallback giving each optimizer step echo2's rate for that step (`LrSchedule.at`), set just before
    the step (TRL's constant scheduler puts the base rate back after it); each rate set is appended to `applied`."""
    from transformers import TrainerCallback

    class Scheduled(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any) -> None:
            rate = schedule.at(state.global_step)
            for group in optimizer.param_groups:
                group["lr"] = rate
            applied.append(rate)

    return Scheduled()


def run_trl(
    out: Path, seed: int, lr: float, steps: int, rounded: bool = False, schedule: LrSchedule | None = None
) -> dict[str, Any]:
    """TRL's GRPOTrainer with echo2's settings; wall time of `train()` (model load excluded). `rounded`: its
    policy rounded to bf16 as echo2's is (`rounded_policy`); the saved model is then the rounded one. `schedule`:
    each step's rate from echo2's schedule (`scheduled_rate`) instead of the constant `lr`."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from echo2cli.models import prepare_default_model
    from echo2cli.tasks import load_task

    model_dir = prepare_default_model()
    task = load_task("arithmetic")
    stream = task.prompts(seed, "train")
    problems = [next(stream) for _ in range(steps * B)]
    by_prompt = {p.prompt: p for p in problems}
    data = Dataset.from_list([{"prompt": list(p.messages)} for p in problems])

    def reward(prompts: list, completions: list, **_: Any) -> list[float]:
        return [
            task.score(by_prompt[p[-1]["content"]], c[0]["content"]).reward
            for p, c in zip(prompts, completions, strict=True)
        ]

    times: list[float] = []
    rates: list[float] = []
    scheduled = [scheduled_rate(schedule, rates)] if schedule else []

    class StepClock(TrainerCallback):
        def on_step_end(self, *a: Any, **kw: Any) -> None:
            times.append(time.time())

    args = GRPOConfig(
        output_dir=str(out),
        seed=seed,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=steps,
        per_device_train_batch_size=B * G,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=MAX_NEW_TOKENS,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        epsilon=0.2,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        shuffle_dataset=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[StepClock(), *([rounded_policy()] if rounded else []), *scheduled],
    )
    t0 = time.time()
    trainer.train()
    wall = time.time() - t0
    trainer.save_model(str(out / "final"))
    tok.save_pretrained(out / "final")
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    step_s = [b - a for a, b in zip([t0, *times], times, strict=False)]
    return {"wall_s": wall, "reward": rewards, "step_s": step_s} | ({"lr_steps": rates} if schedule else {})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("runs/vs-trl"))
    p.add_argument("--seeds", default="0,1", help="seeds for each side, comma-separated")
    p.add_argument(
        "--report-seeds",
        default="",
        help="the seeds the tables and the plot cover, comma-separated (default: every seed in OUT's rows and the "
        "--echo2-runs)",
    )
    p.add_argument("--trl-lrs", default="3e-6,1e-5,3e-5", help="TRL learning rates to run, comma-separated")
    demo_lr = DemoConfig.model_fields["lr"].default
    p.add_argument(
        "--echo2-lrs", default=f"{demo_lr:g}", help="echo2 learning rates to run, comma-separated (the demo's default)"
    )
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--eval-limit", type=int, default=200)
    p.add_argument("--eval-k", type=int, default=4)
    p.add_argument(
        "--eval-every",
        type=int,
        default=2,
        help="also score every N-th echo2 version (greedy): the wall time echo2 took to reach TRL's final "
        "accuracy, seed by seed (0 = the final model only)",
    )
    p.add_argument(
        "--trl-bf16-lrs",
        default="",
        help="also run TRL at these rates with its policy rounded to bf16 as echo2's is (side trl-bf16): "
        "sampled and scored on its fp32 weights rounded, stepped on the fp32 master",
    )
    p.add_argument(
        "--trl-lr-schedule",
        choices=["constant", "linear", "cosine"],
        default="constant",
        help="TRL's rate over its steps, as echo2's learner's --lr-schedule; a side not constant is named after it",
    )
    p.add_argument("--trl-lr-warmup-steps", type=int, default=0, help="as echo2's --lr-warmup-steps")
    p.add_argument("--trl-lr-min-ratio", type=float, default=0.0, help="as echo2's --lr-min-ratio")
    p.add_argument("--skip-echo2", action="store_true")
    p.add_argument(
        "--echo2-runs",
        type=Path,
        action="append",
        default=[],
        help="also report the runs of this `echo2 bench staleness` OUT as echo2 sides (e.g. S = 0 and one worker, "
        "synchronous as TRL is), each named by its staleness, wire dtype and a schedule that is not constant; "
        "repeatable",
    )
    a = p.parse_args()
    if not 0 <= a.trl_lr_warmup_steps < a.steps:
        p.error(f"--trl-lr-warmup-steps {a.trl_lr_warmup_steps} must be at least 0 and less than --steps {a.steps}")
    spec = schedule_spec(a.trl_lr_schedule, a.trl_lr_warmup_steps, a.trl_lr_min_ratio)
    trl_sides = [side if spec == "constant" else f"{side} {spec}" for side in ("trl", "trl-bf16")]
    for out in a.echo2_runs:
        if not (out / "rows.jsonl").is_file():
            p.error(f"--echo2-runs {out}: no rows.jsonl there; give the OUT of an `echo2 bench staleness` run")
    a.out.mkdir(parents=True, exist_ok=True)
    rows_path = a.out / "rows.jsonl"
    done = {r["name"] for r in map(json.loads, rows_path.read_text().splitlines())} if rows_path.exists() else set()
    seeds = [int(s) for s in a.seeds.split(",")]
    plan = [] if a.skip_echo2 else [("echo2", float(lr), s) for lr in a.echo2_lrs.split(",") for s in seeds]
    plan += [(trl_sides[0], float(lr), s) for lr in a.trl_lrs.split(",") for s in seeds]
    plan += [(trl_sides[1], float(lr), s) for lr in a.trl_bf16_lrs.split(",") if lr for s in seeds]
    for side, lr, seed in plan:
        name = f"{side.replace(' ', '-')}-lr{lr:g}-seed{seed}"
        if name in done:
            continue
        out = a.out / name
        if side == "echo2":
            res = run_echo2(out, seed, lr, a.steps, a.eval_every)
            ev = evaluate(["--run", str(out)], a.eval_limit, a.eval_k)
            res["eval_curve"] = echo2_curve(out, {**res, "steps": a.steps}, ev, a.eval_every, a.eval_limit)
            prune(out)  # versions, workers' copies and checkpoints: ~6 GB a run
        else:
            schedule = (
                None
                if spec == "constant"
                else LrSchedule(lr, a.steps, a.trl_lr_schedule, a.trl_lr_warmup_steps, a.trl_lr_min_ratio)
            )
            res = run_trl(out, seed, lr, a.steps, rounded=side.startswith("trl-bf16"), schedule=schedule)
            ev = evaluate(
                ["--model", str(out / "final"), "--max-new-tokens", str(MAX_NEW_TOKENS)], a.eval_limit, a.eval_k
            )
            shutil.rmtree(out / "final")
        row = {"name": name, "side": side, "lr": lr, "seed": seed, "steps": a.steps, **res, **ev}
        with open(rows_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{name}: {row['wall_s']:.0f} s, held-out greedy {row['greedy_accuracy']:.3f}", flush=True)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    rows += [r for out in a.echo2_runs for r in staleness_rows(out)]
    if a.report_seeds:
        shown = {int(s) for s in a.report_seeds.split(",")}
        rows = [r for r in rows if r["seed"] in shown]
    report(rows)
    plot(rows, a.out / "vs_trl.png")
    print(f"plot: {a.out / 'vs_trl.png'}")


def staleness_rows(out: Path) -> list[dict[str, Any]]:
    """echo2's side from the runs of an `echo2 bench staleness` OUT, in this script's row form: the side named
    by the run's staleness, wire dtype and learning rate schedule (when not constant), the learning rate from its
    config.json, the wall time from the learner's start to its last step (as the demo's summary counts it), the
    curve as scored after the run, ending with the final version (the bench's curve has it only where
    `--eval-every` divides the steps)."""
    rows = []
    for r in read_metrics(out / "rows.jsonl"):
        cfg = json.loads((out / r["name"] / "config.json").read_text())
        spec = schedule_spec(
            cfg.get("lr_schedule", "constant"), cfg.get("lr_warmup_steps", 0), cfg.get("lr_min_ratio", 0)
        )
        side = f"echo2 S={cfg['staleness']} {cfg['wire_dtype']}" + ("" if spec == "constant" else f" {spec}")
        curve = [c for c in r["eval_curve"] if c["version"] < r["steps"]]  # the final version, once, last:
        curve.append({"version": r["steps"], "greedy_accuracy": r["eval_greedy_accuracy"], "time_s": r["train_s"]})
        rows.append(
            {"name": f"{side} {r['name']}", "side": side, "lr": cfg["lr"], "seed": r["seed"], "steps": r["steps"]}
            | {"wall_s": r["train_s"], "reward": r["reward"], "time_s": r["time_s"], "eval_curve": curve}
            | {"greedy_accuracy": r["eval_greedy_accuracy"], "pass_at_k": r["eval_pass_at_k"]}
        )
    return rows


def report(rows: list[dict[str, Any]]) -> None:
    keyed: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        keyed.setdefault((r["side"], r["lr"]), []).append(r)
    # the demo's runs set the column's baseline; without them, every echo2 side's
    echo2 = [r["wall_s"] for r in rows if r["side"] == "echo2"] or [
        r["wall_s"] for r in rows if r["side"].startswith("echo2")
    ]
    head = "side | lr | seeds | wall s | s/step | reward first 3 -> last 3 | held-out greedy | pass@k | wall / echo2"
    print(f"| {head} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (side, lr), runs in sorted(keyed.items()):
        wall = statistics.mean(r["wall_s"] for r in runs)
        first = statistics.mean(statistics.mean(r["reward"][:3]) for r in runs)
        last = statistics.mean(statistics.mean(r["reward"][-3:]) for r in runs)
        acc = [r["greedy_accuracy"] for r in runs]
        ratio = f"{wall / statistics.mean(echo2):.2f}x" if echo2 else "-"
        print(
            f"| {side} | {lr:g} | {len(runs)} | {wall:.0f} | {wall / runs[0]['steps']:.1f} | {first:.3f} -> {last:.3f} "
            f"| {statistics.mean(acc):.3f} ({min(acc):.3f}-{max(acc):.3f}) "
            f"| {statistics.mean(r['pass_at_k'] for r in runs):.3f} | {ratio} |"
        )
    report_paired(keyed)


def report_paired(keyed: dict[tuple[str, float], list[dict[str, Any]]]) -> None:
    """echo2 at each of its learning rates against TRL at each of its own, seed by seed
    (echo2cli/bench/paired.py): the difference in held-out accuracy and the ratio of wall times, each with a
    bootstrap 95 % interval over the shared seeds."""
    print(
        "\n| echo2 lr | TRL lr | held-out greedy, echo2 - TRL, paired [95% CI] "
        "| wall time, echo2 / TRL, paired [95% CI] | echo2 reached TRL's final accuracy "
        "| time to it, echo2 / TRL's wall time, paired [95% CI] "
        "| the same, median over all seeds (a miss counts as never) [95% CI] |"
    )
    print("|---|---|---|---|---|---|---|")
    for (side, echo2_lr), echo2 in sorted(keyed.items()):
        if not side.startswith("echo2"):
            continue
        for (other, trl_lr), runs in sorted(keyed.items()):
            if other.startswith("trl"):
                kind, _, spec = other.partition(" ")
                label = f"{trl_lr:g}" + (f", {spec}" if spec else "") + (" (bf16 policy)" if kind == "trl-bf16" else "")
                echo2_label = f"{echo2_lr:g}" + side.removeprefix("echo2").replace(" ", ", ")
                print(f"| {echo2_label} | {label} | {paired_cells(echo2, runs)} |")


def paired_cells(echo2: list[dict[str, Any]], trl: list[dict[str, Any]]) -> str:
    """One row of the paired table: echo2's runs against TRL's, matched by seed."""
    from echo2cli.bench.paired import censored_median, describe, describe_median, paired_difference, seed_mean, time_to

    acc = paired_difference(
        {r["seed"]: r["greedy_accuracy"] for r in echo2}, {r["seed"]: r["greedy_accuracy"] for r in trl}
    )
    trl_wall = {r["seed"]: r["wall_s"] for r in trl}
    ratio = seed_mean({r["seed"]: r["wall_s"] / trl_wall[r["seed"]] for r in echo2 if r["seed"] in trl_wall})
    # the same seed's TRL run sets the target: the first scored echo2 version at or above its final accuracy
    trl_acc = {r["seed"]: r["greedy_accuracy"] for r in trl}
    hits = {r["seed"]: time_to(r.get("eval_curve") or [], trl_acc[r["seed"]]) for r in echo2 if r["seed"] in trl_acc}
    reach = seed_mean({s: t / trl_wall[s] for s, t in hits.items() if t is not None})
    median = censored_median({s: None if t is None else t / trl_wall[s] for s, t in hits.items()})
    return (
        f"{describe(acc)} | {describe(ratio).replace('+', '')} "
        f"| {sum(t is not None for t in hits.values())}/{len(hits)} | {describe(reach).replace('+', '')} "
        f"| {describe_median(median)}"
    )


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Train reward and held-out greedy accuracy against wall time: echo2 (its every N-th version scored) and
    TRL at each learning rate (its final model), each the mean of its seeds with their range as a band (bars
    for TRL's one point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (reward_ax, acc_ax) = plt.subplots(1, 2, figsize=(13, 4.5))
    keyed: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in rows:
        keyed.setdefault((r["side"], r["lr"]), []).append(r)
    for (side, lr), runs in sorted(keyed.items()):
        label = f"{side} lr {lr:g} ({len(runs)} seeds)"
        n = min(len(r["reward"]) for r in runs)
        # echo2 records each step's wall time; TRL each step's duration from the start of train()
        times = [r["time_s"] if side.startswith("echo2") else np.cumsum(r["step_s"]) for r in runs]
        time_s = np.array([t[:n] for t in times]).mean(axis=0)
        reward = np.array([r["reward"][:n] for r in runs])
        (line,) = reward_ax.plot(time_s, reward.mean(axis=0), label=label)
        reward_ax.fill_between(time_s, reward.min(axis=0), reward.max(axis=0), color=line.get_color(), alpha=0.2)
        if side.startswith("echo2"):
            points = min(len(r["eval_curve"]) for r in runs)
            acc = np.array([[c["greedy_accuracy"] for c in r["eval_curve"][:points]] for r in runs])
            at = np.array([[c["time_s"] for c in r["eval_curve"][:points]] for r in runs]).mean(axis=0)
            acc_ax.plot(at, acc.mean(axis=0), marker="o", color=line.get_color(), label=label)
            acc_ax.fill_between(at, acc.min(axis=0), acc.max(axis=0), color=line.get_color(), alpha=0.2)
        else:
            acc = np.array([r["greedy_accuracy"] for r in runs])
            mean = acc.mean()
            bars = [[mean - acc.min()], [acc.max() - mean]]
            wall = np.mean([r["wall_s"] for r in runs])
            acc_ax.errorbar([wall], [mean], yerr=bars, marker="s", color=line.get_color(), label=label, capsize=4)
    reward_ax.set_ylabel("train reward (batch mean)")
    acc_ax.set_ylabel("held-out greedy accuracy")
    for ax in (reward_ax, acc_ax):
        ax.set_xlabel("wall time, s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
