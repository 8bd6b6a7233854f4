import importlib.util
import os
import shutil

import pytest

from echo2cli.learner.coordinator import Coordinator
from echo2cli.protocol import RolloutBatch, Sample
from echo2cli.tasks.arithmetic import ArithmeticTask

pytest_plugins = [
    "budget_report",  # each module's time against tests/budgets.toml
    "integration_fixtures",  # what the integration modules share: an engine, a smaller model, a Hub cache
]

FAILED_MODULES: set[str] = set()  # modules with a failed test (or fixture): their directories are kept to look at


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run the long variants (marker `extended`): the 6-kill churn, the 11,000-request fuzz, the late "
        "joiner on a 30 Mbit/s link, the network cut. Run them before resolving work on the worker, the learner's "
        "API or the broadcast plane; per-push CI does not.",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--extended"):
        return
    skip = pytest.mark.skip(reason="a long variant: run with `bash scripts/test.sh --extended`")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)


# Integration modules that share nothing with the others (no session engine or model) and check no rate or
# deadline a busy CPU could miss (the sharded failures' minute to exit was set for two busy cores): they run in the
# unit process, beside the rest.
BESIDE = ("test_sharded.py", "test_sharded_failure.py", "test_lora_versions.py", "test_nat_swarm.py", "test_reaper.py")


def xdist_scope(nodeid: str) -> str:
    """The unit of work `pytest -n 2` (the test command) hands a process. The integration tests run one after another
    in one process, which makes the shared engine and models once, as in a plain run; the other process takes the
    unit modules, each module whole, and the integration modules in BESIDE. The integration runs alone left one core
    of two idle about 38 % of the time, but the second process mostly competes with them: 10 % saved in all
    (docs/results.md)."""
    module = nodeid.split("::")[0]
    if "/integration/" not in f"/{module}":
        return module
    return module if module.rsplit("/", 1)[-1] in BESIDE else "integration"


if importlib.util.find_spec("xdist") is not None:  # a dev dependency; plain pytest runs without it

    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        class IntegrationApart(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return xdist_scope(nodeid)

        return IntegrationApart(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        FAILED_MODULES.add(item.module.__name__)
    return report


@pytest.fixture(scope="module", autouse=True)
def one_thread_beside_the_integration_runs(request):
    """Under `pytest -n 2`, the modules beside the integration process (the unit modules and BESIDE) compute on one
    thread, and so do the processes they start (OMP_NUM_THREADS): two processes each running torch on every core
    of a 2-core box oversubscribe it."""
    if "PYTEST_XDIST_WORKER" not in os.environ or xdist_scope(request.node.nodeid) == "integration":
        yield
        return
    import torch

    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def module_dirs_removed(request, tmp_path_factory):
    """What a module's tests wrote under pytest's base directory goes when the module ends, if all of them passed.
    pytest itself removes a passing test's `tmp_path` at once but keeps a module fixture's `mktemp` directory until
    the session ends: a run of the whole suite then held every integration run's checkpoints and versions at once
    (6 GB for the sharded learner alone) on a disk that may have a few GB free."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    if request.module.__name__ in FAILED_MODULES:
        return
    for path in set(base.iterdir()) - before:
        shutil.rmtree(path, ignore_errors=True)


def make_clock():
    """A fake clock: `tick()` reads it, `tick(dt)` advances it by dt seconds."""
    now = [1000.0]

    def tick(dt: float = 0.0) -> float:
        now[0] += dt
        return now[0]

    return tick


# the run's settings a JoinResponse carries, for apps built in tests (`build_app(join_info=...)`)
JOIN_INFO = dict(
    task="arithmetic",
    group_size=2,
    max_new_tokens=8,
    temperature=1.0,
    staleness=1,
    heartbeat_s=2.0,
    model_files=["config.json"],
)


@pytest.fixture
def clock():
    return make_clock()


def make_coord(clock, *, G=2, S=1, B=2, lease_timeout_s=60.0) -> Coordinator:
    return Coordinator(
        ArithmeticTask(),
        encode_prompt=lambda messages: [ord(c) % 100 for c in messages[-1]["content"][:8]],
        decode=lambda ids: " ".join(str(i) for i in ids),
        group_size=G,
        staleness=S,
        prompts_per_step=B,
        max_new_tokens=8,
        vocab_size=1000,
        lease_timeout_s=lease_timeout_s,
        heartbeat_s=2.0,
        seed=0,
        clock=clock,
    )


def answer_tokens(coord: Coordinator, prompt_id: int) -> list[int]:
    """Completion tokens that decode (with the fake decoder above) to the right answer."""
    return [abs(int(coord.prompts.problems[prompt_id].answer))]


def batch_for(coord, worker_id, lease, *, G=2, right=True, version=None) -> RolloutBatch:
    samples = [
        Sample(
            prompt_id=p.prompt_id,
            sample_idx=i,
            completion_token_ids=answer_tokens(coord, p.prompt_id) if right else [999],
            logprobs=[-0.5],
        )
        for p in lease.prompts
        for i in range(G)
    ]
    return RolloutBatch(
        worker_id=worker_id,
        lease_id=lease.lease_id,
        version=lease.version if version is None else version,
        samples=samples,
    )
