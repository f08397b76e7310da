"""Tasks with a broken reward, loaded by tests through task.name = "tests._bad_tasks:..."."""

from titan_rl.tasks import DigitReverseTask


class NanRewardTask(DigitReverseTask):
    """Reward NaN for every `every`-th completion (1 = always)."""

    def __init__(self, every: int = 1, **kw):
        super().__init__(**kw)
        self.every, self.calls = every, 0

    def reward(self, example, completion_ids):
        self.calls += 1
        return float("nan") if self.calls % self.every == 0 else super().reward(example, completion_ids)


class BrokenSampleTask(DigitReverseTask):
    """A prompt source that fails (as a dataset that cannot be read would)."""

    def sample(self, n, seed):
        raise FileNotFoundError("prompts.jsonl")
