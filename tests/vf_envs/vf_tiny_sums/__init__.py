"""A tiny verifiers (v1) environment for the tests: "What is 3 + 4?", reward 1 when the last number of the reply
is the sum. Loaded by id `vf-tiny-sums` once tests/vf_envs is on sys.path, as an installed environment would be."""

import re

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: int


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(numbers) and int(numbers[-1]) == self.data.answer)


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 40


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        for i in range(self.config.num_tasks):
            a, b = (7 * i) % 10 + 1, (3 * i) % 9 + 1
            yield SumTask(
                SumData(
                    id=f"sum-{i}",
                    system_prompt="Answer with just the number.",
                    prompt=[
                        vf.UserMessage(content="What is 1 + 1?"),
                        vf.AssistantMessage(content="2"),
                        vf.UserMessage(content=f"What is {a} + {b}?"),
                    ],
                    answer=a + b,
                ),
                self.config.task,
            )


__all__ = ["SumTaskset"]
