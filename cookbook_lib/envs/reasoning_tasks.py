"""reasoning-gym's procedural datasets as tasks, scored by each dataset's own ``score_answer``.

    tasks = reasoning_gym_tasks("chain_sum", n=64, seed=0)
    env_factory = lambda task: ReasoningGymEnv(calculator=True)   # arithmetic: give it the calculator

Each entry becomes a :class:`Task` (the question as the prompt, the answer as the target, the entry
in the metadata, as JSON); :class:`ReasoningGymEnv` asks for the final answer alone and scores the
reply with the dataset's scorer (reasoning-gym's own notion of a right answer: partial credit where
the dataset gives it). With ``calculator=True`` the model also gets the repository's calculator
tool (``envs/math_env.py``), which fits the arithmetic datasets (``chain_sum``,
``basic_arithmetic``, ...). ``pip install -e ".[envs]"`` installs reasoning-gym.
"""

from __future__ import annotations

from typing import Any

from cookbook_lib.envs.base import Task, Tool
from cookbook_lib.envs.tool_env import ToolEnv
from cookbook_lib.runtime.jsonl import jsonable
from cookbook_lib.types import Message

INSTALL_HINT = 'reasoning-gym is not installed: pip install -e ".[envs]" (or pip install reasoning-gym)'
SYSTEM_PROMPT = "Solve the problem. Reply with only the final answer, nothing else."
CALCULATOR_PROMPT = (
    "Solve the problem. Use the calculator tool for arithmetic, then reply with only the final answer."
)


def _reasoning_gym() -> Any:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return reasoning_gym


def reasoning_gym_tasks(name: str, n: int, seed: int = 0, **dataset_config: Any) -> list[Task]:
    """``n`` entries of the dataset ``name`` (any reasoning-gym dataset, configured by
    ``dataset_config``), drawn with ``seed``, as tasks."""
    dataset = _reasoning_gym().create_dataset(name, size=n, seed=seed, **dataset_config)
    return [
        Task(
            prompt=str(entry["question"]),
            target=str(entry["answer"]),
            metadata={"dataset": name, "entry": jsonable(dict(entry))},
        )
        for entry in dataset
    ]


class ReasoningGymEnv(ToolEnv):
    """One reasoning-gym question; the final reply is scored by its dataset's ``score_answer``."""

    def __init__(self, *, calculator: bool = False, tool_timeout_s: float | None = 30.0) -> None:
        tools: list[Tool] = []
        if calculator:
            from envs.math_env import CalculatorTool  # the repository's safe calculator

            tools.append(CalculatorTool())
        super().__init__(tools, tool_timeout_s=tool_timeout_s)
        self.system_prompt = CALCULATOR_PROMPT if calculator else SYSTEM_PROMPT
        self._scorers: dict[str, Any] = {}

    def score(self, task: Task, messages: list[Message]) -> float:
        final = messages[-1]
        if final.get("role") != "assistant" or final.get("tool_calls"):
            return 0.0  # ended by a tool, without a final answer
        name = str(task.metadata["dataset"])
        if name not in self._scorers:
            self._scorers[name] = _reasoning_gym().get_score_answer_fn(name)
        return float(
            self._scorers[name](answer=final.get("content", "").strip(), entry=task.metadata["entry"])
        )
