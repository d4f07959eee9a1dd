"""``torchlike online_dpo``: Online DPO from the command line, as TRL's ``examples/scripts/online_dpo.py`` runs
``trl.experimental.online_dpo`` (TRL 1.16's ``trl`` command has no ``online_dpo``).

The completions are ranked by a reward model (``--reward_model_path``, an ``OnlineDPOConfig`` field) and/or reward
functions named with ``--reward_funcs`` (TRL's registry names or dotted import paths, as in ``torchlike grpo``).

Example:
    ```bash
    torchlike online_dpo --model_name_or_path Qwen/Qwen2-0.5B-Instruct --dataset_name trl-lib/ultrafeedback-prompt \\
        --reward_model_path trl-lib/Qwen2-0.5B-Reward --max_new_tokens 64 --output_dir Qwen2-0.5B-Online-DPO
    ```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torchlike.trl.experimental.online_dpo.online_dpo_config import OnlineDPOConfig
from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from torchlike.trl.scripts.common import run_training_script
from torchlike.trl.scripts.grpo import GRPOScriptArguments, load_reward_funcs


@dataclass
class OnlineDPOScriptArguments(ScriptArguments):
    """``ScriptArguments`` plus the reward functions.

    Args:
        reward_funcs: registry names or dotted import paths of reward functions (beside ``--reward_model_path``).
    """

    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions ranking the two completions of each prompt: `accuracy_reward`, "
                          "`reasoning_accuracy_reward`, `think_format_reward`, `get_soft_overlong_punishment`, or any "
                          "dotted import path (e.g. 'my_lib.rewards.custom_reward'); added to --reward_model_path."},
    )


def make_parser(prog: str | None = None) -> TrlParser:
    """The online DPO script's parser: ``OnlineDPOScriptArguments``, ``OnlineDPOConfig``, ``ModelConfig``,
    ``DatasetMixtureConfig``."""
    return TrlParser((OnlineDPOScriptArguments, OnlineDPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: OnlineDPOScriptArguments, training_args: OnlineDPOConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``OnlineDPOTrainer`` (the tokenizer of ``--model_name_or_path``; the reward model of
    ``--reward_model_path`` first, then ``--reward_funcs``) and save the model to ``output_dir``; returns the trainer.

    Raises:
        ValueError: neither ``--reward_model_path`` nor ``--reward_funcs``.
    """
    from torchlike import AutoTokenizer
    from torchlike.trl.experimental.online_dpo.online_dpo_trainer import OnlineDPOTrainer

    reward_funcs = load_reward_funcs(GRPOScriptArguments(reward_model_name_or_path=training_args.reward_model_path,
                                                         reward_funcs=script_args.reward_funcs))
    if not reward_funcs:
        raise ValueError("Online DPO ranks its completions with a reward: set `--reward_model_path` and/or "
                         "`--reward_funcs`.")
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                              trust_remote_code=training_args.trust_remote_code)
    return run_training_script(OnlineDPOTrainer, script_args, training_args, model_args, dataset_args,
                               reward_funcs=reward_funcs, processing_class=tokenizer)


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
