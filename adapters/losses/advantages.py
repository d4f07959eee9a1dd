"""Rewards to advantages, the pieces GRPO and RLOO share: the NaN-aware standard deviation, the weighted sum of the
reward functions' rewards, and the group layout check.

TRL marks a completion no reward function could score with ``None`` rewards; here they are NaN, left out of every
statistic. Each function names the TRL code it reproduces. Shapes: ``N`` completions, ``F`` reward functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

#: Added to the reward standard deviation before dividing (TRL's constant).
REWARD_STD_EPSILON = 1e-4


def nanstd(values: jax.Array, axis: int | None = None, keepdims: bool = False) -> jax.Array:
    """Standard deviation over the non-NaN entries with Bessel's correction, as ``trl.trainer.utils.nanstd``.

    ``sqrt(nanmean((x - nanmean(x))**2) * n / (n - 1))`` with ``n`` the number of non-NaN entries; NaN where
    ``n < 2``.

    Args:
        values: any shape.
        axis: axis to reduce; ``None`` reduces all.
        keepdims: keep the reduced axis with size 1.

    Returns:
        The standard deviation, float32.
    """
    values = jnp.asarray(values, jnp.float32)
    mean = jnp.nanmean(values, axis=axis, keepdims=True)
    variance = jnp.nanmean((values - mean) ** 2, axis=axis, keepdims=keepdims)
    count = jnp.sum(~jnp.isnan(values), axis=axis, keepdims=keepdims).astype(jnp.float32)
    correction = jnp.where(count > 1, count / jnp.maximum(count - 1, 1), jnp.nan)
    return jnp.sqrt(variance * correction)


def reward_weight_vector(reward_weights: Sequence[float] | jax.Array | None, num_funcs: int) -> jax.Array:
    """``[F]`` float32 weights of the reward functions: ``reward_weights``, or 1.0 each when it is ``None``.

    Raises:
        ValueError: not one weight per reward function.
    """
    if reward_weights is None:
        return jnp.ones(num_funcs, jnp.float32)
    weights = jnp.asarray(reward_weights, jnp.float32)
    if weights.shape != (num_funcs,):
        raise ValueError(f"reward_weights has shape {weights.shape} but there are {num_funcs} reward functions; give "
                         "one weight per reward function.")
    return weights


def weighted_reward_sum(values: jax.Array, weights: jax.Array, rewards_per_func: jax.Array) -> jax.Array:
    """``nansum_f(values * weights)``, NaN on the rows where every raw reward is NaN (unscorable completions).

    Args:
        values: ``[N, F]`` the (possibly normalised) rewards to sum.
        weights: ``[F]`` (:func:`reward_weight_vector`).
        rewards_per_func: ``[N, F]`` the raw rewards, NaN where a function returned ``None``.

    Returns:
        ``[N]`` float32.
    """
    return jnp.where(jnp.isnan(rewards_per_func).all(axis=1), jnp.nan, jnp.nansum(values * weights, axis=1))


def combine_rewards(rewards_per_func: jax.Array, reward_weights: Sequence[float] | jax.Array | None = None
                    ) -> jax.Array:
    """One reward per completion: the weighted sum over reward functions, skipping ``None`` (NaN) rewards.

    ``reward[n] = nansum_f(rewards_per_func[n, f] * reward_weights[f])``, and NaN where every function returned
    ``None`` for completion ``n`` (TRL marks those rows unscorable so the group baseline skips them).

    Args:
        rewards_per_func: ``[N, F]``; NaN where a function returned ``None``.
        reward_weights: ``[F]``; ``None`` weighs every function 1.0.

    Returns:
        ``[N]`` float32.
    """
    rewards_per_func = jnp.asarray(rewards_per_func, jnp.float32)
    weights = reward_weight_vector(reward_weights, rewards_per_func.shape[1])
    return weighted_reward_sum(rewards_per_func, weights, rewards_per_func)


def check_groups(num_completions: int, num_generations: int) -> None:
    """Raises ``ValueError`` unless the completions split into whole groups of ``num_generations``."""
    if num_generations < 1 or num_completions % num_generations:
        raise ValueError(f"{num_completions} rewards do not split into groups of num_generations={num_generations}; "
                         "each prompt's completions must be consecutive and complete.")


def reward_metrics(rewards: jax.Array, rewards_per_func: jax.Array, group_std: jax.Array) -> dict[str, jax.Array]:
    """TRL's logged reward metrics of a generation batch (GRPO's and RLOO's ``_generate_and_score_completions``).

    Args:
        rewards: ``[N]`` the combined reward of each completion.
        rewards_per_func: ``[N, F]`` each reward function's value (NaN where a function returned ``None``).
        group_std: ``[N]`` the standard deviation of each completion's group.

    Returns:
        ``reward`` and ``reward_std`` (NaN-aware), ``frac_reward_zero_std`` (the share of completions whose group has
        zero spread), and ``rewards_per_func/mean`` and ``/std`` (``[F]``).
    """
    return {
        "reward": jnp.nanmean(rewards),
        "reward_std": nanstd(rewards),
        "frac_reward_zero_std": jnp.isclose(group_std, 0.0).astype(jnp.float32).mean(),
        "rewards_per_func/mean": jnp.nanmean(rewards_per_func, axis=0),
        "rewards_per_func/std": nanstd(rewards_per_func, axis=0),
    }
