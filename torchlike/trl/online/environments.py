"""GRPO's ``environment_factory``: TRL 1.16's agent environments as prompt sources, tools and reward sources.

What ``trl.GRPOTrainer`` does with an ``environment_factory`` (its constructor's probing and
``_generate_and_score_completions``' per-batch set-up), reimplemented without importing TRL:

1. Each factory is called once at construction; the instance must define ``reset``; its public methods (every function
   of its class but ``reset``, ``get_reward`` and ``_private`` ones, in name order) are its tools, rendered in the
   prompts of the rows that use it after any standalone ``tools``. An environment class with ``get_reward`` adds one
   reward function named after the class (weight 1), which scores the rollouts of that exact class and returns
   ``None`` for the others.
2. A dict of factories routes each row by its ``environment`` column; a single factory serves every row.
3. Every rollout (each of a prompt's ``num_generations`` samples) gets its own instance from a pool kept across
   batches: the i-th rollout of an environment in a batch takes the pool's i-th instance, created when the pool is
   short ("construct once, reset often").
4. ``reset(**row)`` is called with the row's columns (without ``environment`` when routing); a string or
   content-block list it returns is appended to the content of the prompt's last message.
5. The rollout's tool calls run on its own instance's methods, and reward functions receive the instances as
   ``environments``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import transformers
from packaging.version import Version

from .tool_calling import require_tool_template

__all__ = ["EMPTY_PROMPT", "EnvironmentPool"]

#: The prompt of a row without one (an environment returns the prompt from ``reset``), as TRL's placeholder.
EMPTY_PROMPT = [{"role": "user", "content": ""}]

_CONTROL_METHODS = ("reset", "get_reward")


def _method_names(environment_class: type) -> list[str]:
    """The public functions of an environment's class in name order (listed on the class, as TRL does, so that
    reading them evaluates no property)."""
    return [name for name, _ in inspect.getmembers(environment_class, predicate=inspect.isfunction)
            if name not in _CONTROL_METHODS and not name.startswith("_")]


def _defines(environment_class: type, name: str) -> bool:
    return any(member == name for member, _ in inspect.getmembers(environment_class, predicate=inspect.isfunction))


def environment_reward(environment_class: type) -> Callable[..., list[float | None]]:
    """The reward function of an environment class that defines ``get_reward``: ``get_reward()`` of each rollout's
    instance of exactly that class, ``None`` for other rollouts; ``async`` when ``get_reward`` is. Named after the
    class (its metrics are ``rewards/<class name>/*``)."""
    if inspect.iscoroutinefunction(environment_class.get_reward):
        async def reward(environments: list, **kwargs: Any) -> list[float | None]:
            return [await environment.get_reward() if type(environment) is environment_class else None
                    for environment in environments]
    else:
        def reward(environments: list, **kwargs: Any) -> list[float | None]:
            return [environment.get_reward() if type(environment) is environment_class else None
                    for environment in environments]
    reward.__name__ = reward.__qualname__ = environment_class.__name__
    return reward


@dataclass
class EnvironmentPool:
    """A trainer's environments: their factories, pooled instances, tools and reward functions (build with
    :meth:`create`).

    Args:
        factories: ``{name: factory}``; a single factory is stored under ``None``.
        routed: whether rows choose their environment by their ``environment`` column (a dict was given).
        standalone_tools: the trainer's ``tools``, offered alongside every environment's methods.
        pools: the instances of each environment, reused across batches.
        schema_tools: the tools each environment's prompts render: the standalone tools, then the methods of the
            instance probed at construction.
        reward_functions: one per environment class that defines ``get_reward`` (:func:`environment_reward`).
    """

    factories: dict[str | None, Callable[[], Any]]
    routed: bool
    standalone_tools: list[Callable]
    pools: dict[str | None, list[Any]] = field(default_factory=dict)
    schema_tools: dict[str | None, list[Callable]] = field(default_factory=dict)
    reward_functions: list[Callable] = field(default_factory=list)

    @classmethod
    def create(cls, environment_factory: Callable[[], Any] | Mapping[str, Callable[[], Any]],
               tools: Sequence[Callable], tokenizer: transformers.PreTrainedTokenizerBase,
               trainer_name: str = "GRPOTrainer") -> EnvironmentPool:
        """TRL's checks of the tokenizer, then one probed instance of each environment (the first of its pool), as
        TRL's constructor does.

        Args:
            environment_factory: a factory, or ``{name: factory}``.
            tools: the trainer's standalone ``tools``.
            tokenizer: the tokenizer whose chat template renders the tools.
            trainer_name: the trainer named in TRL's messages.

        Raises:
            ImportError: transformers older than 5.2.
            ValueError: a chat template that cannot render a tool exchange, or an instance without a ``reset`` method
                (TRL's messages).
        """
        if Version(transformers.__version__) < Version("5.2.0"):
            raise ImportError(f"Using `environment_factory` with {trainer_name} requires transformers version 5.2.0 or "
                              "higher. Please install transformers from the main branch with `pip install "
                              "git+https://github.com/huggingface/transformers.git@main` to use this feature.")
        require_tool_template(tokenizer)
        routed = isinstance(environment_factory, Mapping)
        factories = dict(environment_factory) if routed else {None: environment_factory}
        environments = cls(factories, routed, list(tools))
        rewarded: list[type] = []
        for name, factory in factories.items():
            instance = factory()
            environment_class = type(instance)
            if not _defines(environment_class, "reset"):
                raise ValueError("Each environment instance returned by `environment_factory` must define a callable "
                                 "`reset`.")
            environments.pools[name] = [instance]
            environments.schema_tools[name] = environments.standalone_tools + environments._methods(instance)
            if _defines(environment_class, "get_reward") and environment_class not in rewarded:
                rewarded.append(environment_class)
                environments.reward_functions.append(environment_reward(environment_class))
        return environments

    @property
    def tools(self) -> list[Callable]:
        """Every tool some prompt may render: the standalone tools, then each environment's methods."""
        union = list(self.standalone_tools)
        for tools in self.schema_tools.values():
            union += [tool for tool in tools if tool not in union]
        return union

    @staticmethod
    def _methods(instance: object) -> list[Callable]:
        return [getattr(instance, name) for name in _method_names(type(instance))]

    def name_of(self, row: Mapping[str, Any]) -> str | None:
        """The environment a row uses: its ``environment`` column when routing, else the single one."""
        return row.get("environment") if self.routed else None

    def assign(self, rows: Sequence[Mapping[str, Any]]) -> list[Any]:
        """One instance per rollout of a batch, in row order, from the pools (grown when a batch needs more).

        Raises:
            ValueError: a row names an environment that was not given (TRL's message).
        """
        names = [self.name_of(row) for row in rows]
        for name in dict.fromkeys(names):
            if name not in self.factories:
                raise ValueError(f"Example has `environment={name!r}`, which is not among the environments passed to "
                                 f"`environment_factory`. Expected one of: {list(self.factories)}.")
        handed_out: dict[str | None, int] = {}
        instances = []
        for name in names:
            pool, index = self.pools[name], handed_out.get(name, 0)
            if index == len(pool):
                pool.append(self.factories[name]())
            handed_out[name] = index + 1
            instances.append(pool[index])
        return instances

    def tools_of(self, instance: object) -> list[Callable]:
        """The tools one rollout's calls may run: the standalone tools, then its own instance's methods."""
        return self.standalone_tools + self._methods(instance)

    def reset(self, instance: object, row: Mapping[str, Any]) -> list[dict]:
        """Resets a rollout's instance with the row's columns and returns its prompt: the row's (or
        :data:`EMPTY_PROMPT`) with the observation ``reset`` returned appended to the last message's content."""
        columns = {key: value for key, value in row.items() if key != "environment"} if self.routed else dict(row)
        prompt = row["prompt"] if "prompt" in row else [dict(message) for message in EMPTY_PROMPT]
        observation = instance.reset(**columns)
        if observation is None:
            return prompt
        content = prompt[-1]["content"]
        if isinstance(observation, list) and isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if isinstance(observation, str) and isinstance(content, list):
            observation = [{"type": "text", "text": observation}]
        return prompt[:-1] + [{**prompt[-1], "content": content + observation}]
