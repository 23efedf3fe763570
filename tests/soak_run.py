"""The training process of the soak test (tests/test_soak.py), run as its own process so the test
can kill it with SIGKILL and measure its memory alone.

    python tests/soak_run.py MODEL_DIR RUNS_DIR EVENTS_FILE RSS_FILE NUM_STEPS

It trains the tiny model with GRPO on :class:`FaultyEnv`, a cheap environment whose replies go
through a real tool, with faults injected in a few percent of resets, steps and tool calls. Each
environment appends its life events (``create``, ``reset``, ``close``) to EVENTS_FILE, and each
step appends ``step rss_bytes`` to RSS_FILE, so the test can check from outside that every
environment was closed exactly once and that memory stayed flat.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import sys
from pathlib import Path
from typing import Any, ClassVar

from cookbook_lib.envs import Env, StepResult, Task, ToolResult, run_tool_calls
from cookbook_lib.grpo.config import GRPOConfig
from cookbook_lib.grpo.train import train_multi_turn
from cookbook_lib.types import Message, ToolSpec, make_tool_call

FAULT_RATE = 0.04  # of resets, steps and tool calls each
KEEP_LAST_CHECKPOINTS = 2
CHECKPOINT_INTERVAL = 10
TASKS = [Task(prompt=f"Word {i}?", target=None) for i in range(8)]


class InjectedFault(RuntimeError):
    """A fault the soak injects on purpose."""


class VowelTool:
    """Scores a reply: the share of its letters that are vowels. Fails now and then, on purpose."""

    name = "vowels"
    description = "Share of vowels."
    parameters_schema: ClassVar[dict[str, Any]] = {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    }

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    async def execute(self, arguments: str) -> ToolResult:
        if self.rng.random() < FAULT_RATE:
            raise InjectedFault("injected tool fault")
        letters = [c for c in json.loads(arguments)["text"].lower() if c.isalpha()]
        share = sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0
        return ToolResult(content=f"{share:.3f}")


class FaultyEnv(Env):
    """One turn: the reply goes to the tool as its argument, and the tool's score is the reward.
    Faults: reset and step raise (an ERROR episode), the tool fails (a tool_error, reward 0)."""

    _ids = itertools.count()

    def __init__(self, events_path: Path, rng: random.Random) -> None:
        self.id = f"{os.getpid()}-{next(self._ids)}"
        self.events_path = events_path
        self.rng = rng
        self.tool = VowelTool(rng)
        self._messages: list[Message] = []
        self._log("create")

    def _log(self, event: str) -> None:
        # One short append per event: whole lines even when the process is killed mid-run.
        with self.events_path.open("a", encoding="utf-8") as events:
            events.write(f"{event} {self.id}\n")

    async def reset(self, task: Task) -> list[Message]:
        self._log("reset")
        if self.rng.random() < FAULT_RATE:
            self._log("reset_fault")
            raise InjectedFault("injected reset fault")
        self._messages = [Message(role="user", content=task.prompt)]
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        if self.rng.random() < FAULT_RATE:
            self._log("step_fault")
            raise InjectedFault("injected step fault")
        # The reply, untrusted text, goes through a real tool call as its argument.
        call = make_tool_call("score", self.tool.name, {"text": message.get("content", "")})
        outcome = await run_tool_calls(
            {self.tool.name: self.tool}, Message(role="assistant", content="", tool_calls=[call])
        )
        if outcome.num_errors:
            self._log("tool_fault")
        reward = 0.0 if outcome.num_errors else float(outcome.messages[0]["content"])
        self._messages += [message, *outcome.messages]
        return StepResult(terminated=True, truncated=False, messages=list(self._messages), reward=reward)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        # The env calls its tool itself, on every first reply; not offering it to the model keeps
        # the prompt at ~40 tokens instead of ~220, and the soak's steps cheap.
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    async def close(self) -> None:
        self._log("close")


def resident_bytes() -> int:
    """This process's resident set size, from /proc (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main(model_dir: str, runs_dir: str, events_file: str, rss_file: str, num_steps: int) -> None:
    events_path, rss_path = Path(events_file), Path(rss_file)
    rng = random.Random(os.getpid())  # each process its own faults; the test checks counts, not which
    config = GRPOConfig(
        model=model_dir,
        runs_dir=runs_dir,
        run_name="soak",
        num_steps=num_steps,
        batch_size=1,
        episodes_per_task=2,
        max_turns=1,
        max_tokens_per_turn=3,
        max_model_length=128,
        micro_batch_tokens=128,
        overlong_buffer_tokens=8,
        learning_rate=1e-4,
        checkpoint_interval=CHECKPOINT_INTERVAL,
        keep_last_checkpoints=KEEP_LAST_CHECKPOINTS,
        validation_interval=0,
        device="cpu",
        dtype="float32",
    )

    def record_rss(outcome: Any) -> None:
        with rss_path.open("a", encoding="utf-8") as out:
            out.write(f"{outcome.step} {resident_bytes()}\n")

    train_multi_turn(
        config,
        tasks=TASKS,
        env_factory=lambda task: FaultyEnv(events_path, rng),
        on_step=record_rss,
    )


if __name__ == "__main__":
    model, runs, events, rss, steps = sys.argv[1:]
    main(model, runs, events, rss, int(steps))
