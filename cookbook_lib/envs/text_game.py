"""Text games as environments: an observation, the model's reply as the action, the next observation,
a reward, until the game is over. The shapes the ecosystem's text games come in:

- **gymnasium-style** (GEM's games, any ``reset(seed) -> (obs, info)`` /
  ``step(action) -> (obs, reward, terminated, truncated, info)`` env with text observations):
  ``TextGameEnv.from_gymnasium(lambda: gem.make("game:GuessTheNumber-v0-easy"))``;
- **TextArena's** single-player games (``reset(num_players, seed)``, ``get_observation()``,
  ``step(action) -> (done, info)``, rewards from ``close()``):
  ``TextGameEnv.from_textarena(lambda: textarena.make("GuessTheNumber-v0"))``.

Each gives an env factory for ``evaluate`` / ``train_multi_turn``; :func:`text_game_tasks` gives
the tasks, one game seed each. The model's reply (its ``content``: reasoning is kept apart by the
codec) is the action; the game's observation comes back as a user message. A game that ends the
episode itself ends it ``terminated``, one that cuts it ``truncated`` (end cause ``ENV``); the
reward is the game's, in its own range (GEM gives -0.1 for an invalid move).

Some games reseed Python's and numpy's global random generators (GEM does on every ``reset``);
the env restores both after every call into the game, so a run's own seeding is untouched.
"""

from __future__ import annotations

import abc
import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

from cookbook_lib.envs.base import Env, StepResult, Task
from cookbook_lib.types import Message, ToolSpec

EnvFactory = Callable[[Task], Env]


@contextlib.contextmanager
def global_rng_kept() -> Iterator[None]:
    """Run a block, then put Python's and numpy's global random states back as they were."""
    import numpy as np

    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


class TextGame(abc.ABC):
    """One game, reduced to what a conversation needs: the opening text, then (text, reward,
    terminated, truncated) per move."""

    @abc.abstractmethod
    def reset(self, seed: int | None) -> str: ...

    @abc.abstractmethod
    def step(self, action: str) -> tuple[str, float, bool, bool]: ...

    def close(self) -> None:  # noqa: B027 - optional, as Env.close
        pass


class GymnasiumGame(TextGame):
    """A gymnasium-style env with text observations (GEM's games)."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self._suffix = ""

    def reset(self, seed: int | None) -> str:
        observation, info = self.env.reset(seed=seed)
        return self._text(observation, info)

    def step(self, action: str) -> tuple[str, float, bool, bool]:
        observation, reward, terminated, truncated, info = self.env.step(action)
        over = bool(terminated) or bool(truncated)
        return (
            self._text(observation, None if over else info),
            float(reward),
            bool(terminated),
            bool(truncated),
        )

    def _text(self, observation: Any, info: Any) -> str:
        # GEM puts the prompt for the next move ("Enter your next guess.") in info["suffix"]; it is
        # left out once the game is over.
        suffix = info.get("suffix") if isinstance(info, dict) else None
        text = str(observation)
        return f"{text}\n{suffix}" if isinstance(suffix, str) and suffix else text

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if callable(close):
            close()


class TextArenaGame(TextGame):
    """A TextArena single-player game. Its observation is the whole game so far, so each move's
    text is what was added since the last one; the reward comes from ``close()`` at the end."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self._shown = ""

    def reset(self, seed: int | None) -> str:
        self.env.reset(num_players=1, seed=seed)
        _, observation = self.env.get_observation()
        self._shown = str(observation)
        return self._shown

    def step(self, action: str) -> tuple[str, float, bool, bool]:
        done, _ = self.env.step(action)
        if done:
            rewards, _ = self.env.close()
            reward = float((rewards or {}).get(0, 0.0))
            return "The game is over.", reward, True, False
        _, observation = self.env.get_observation()
        observation = str(observation)
        new = observation[len(self._shown) :] if observation.startswith(self._shown) else observation
        self._shown = observation
        return new.strip() or observation, 0.0, False, False


class TextGameEnv(Env):
    """A :class:`TextGame` as an :class:`Env`: no tools; the reply is the move."""

    def __init__(self, game: TextGame, *, system_prompt: str | None = None) -> None:
        self.game = game
        self.system_prompt = system_prompt
        self._messages: list[Message] = []
        self._moves = 0

    @classmethod
    def from_gymnasium(cls, make_env: Callable[[], Any], *, system_prompt: str | None = None) -> EnvFactory:
        """An env factory over ``make_env()``, a gymnasium-style text env (a fresh one per episode)."""
        return lambda task: cls(GymnasiumGame(_made(make_env)), system_prompt=system_prompt)

    @classmethod
    def from_textarena(cls, make_env: Callable[[], Any], *, system_prompt: str | None = None) -> EnvFactory:
        """An env factory over ``make_env()``, a TextArena single-player game."""
        return lambda task: cls(TextArenaGame(_made(make_env)), system_prompt=system_prompt)

    async def reset(self, task: Task) -> list[Message]:
        seed = task.metadata.get("seed")
        with global_rng_kept():
            opening = self.game.reset(seed if isinstance(seed, int) else None)
        self._moves = 0
        self._messages = [Message(role="user", content=opening)]
        if self.system_prompt:
            self._messages.insert(0, Message(role="system", content=self.system_prompt))
        return list(self._messages)

    async def step(self, message: Message) -> StepResult:
        self._messages.append(message)
        with global_rng_kept():
            text, reward, terminated, truncated = self.game.step(message.get("content", ""))
        self._moves += 1
        self._messages.append(Message(role="user", content=text))
        return StepResult(
            terminated=terminated,
            truncated=truncated and not terminated,
            messages=list(self._messages),
            reward=reward,
            metrics={"moves": float(self._moves)},
        )

    @property
    def tool_specs(self) -> list[ToolSpec]:
        return []

    @property
    def messages(self) -> list[Message]:
        return list(self._messages)

    async def close(self) -> None:
        with global_rng_kept():
            self.game.close()


def _made(make_env: Callable[[], Any]) -> Any:
    with global_rng_kept():  # building a game may seed the global generators too
        return make_env()


def text_game_tasks(name: str, n: int, seed: int = 0) -> list[Task]:
    """``n`` tasks of the game ``name``, one game seed each (``seed``, ``seed + 1``, ...): the
    game writes its own opening, so the task's prompt only names the game and its seed."""
    return [Task(prompt=f"{name} #{seed + i}", metadata={"game": name, "seed": seed + i}) for i in range(n)]
