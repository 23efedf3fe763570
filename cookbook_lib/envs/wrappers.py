"""``EnvWrapper``: an :class:`Env` that passes everything through to the env it wraps.

Subclasses override only what they add (counting steps, timing them) and call ``super()`` for
the rest, so the wrapped env's contract holds unchanged: the same messages, the same tool specs,
and ``close`` called exactly once on the inner env for each call on the wrapper.
"""

from __future__ import annotations

from cookbook_lib.envs.base import Env, StepResult, Task
from cookbook_lib.types import Message, ToolSpec


class EnvWrapper(Env):
    """Delegates every member of :class:`Env` to ``inner``."""

    def __init__(self, inner: Env) -> None:
        self.inner = inner

    async def reset(self, task: Task) -> list[Message]:
        return await self.inner.reset(task)

    async def step(self, message: Message) -> StepResult:
        return await self.inner.step(message)

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return self.inner.tool_specs

    @property
    def messages(self) -> list[Message]:
        return self.inner.messages

    async def close(self) -> None:
        await self.inner.close()
