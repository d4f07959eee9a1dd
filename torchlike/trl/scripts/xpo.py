"""``torchlike xpo``: exploratory preference optimisation from the command line, as TRL 1.0.0's
``examples/scripts/xpo.py`` runs ``trl.experimental.xpo``.

One reward ranks each prompt's two completions (the policy's and the reference's): a reward model
(``--reward_model_path``, an ``XPOConfig`` field) or one reward function (``--reward_funcs``, TRL's registry names or
a dotted import path, as in ``torchlike online_dpo``). TRL's script also offers ``--judge pair_rm|openai|hf``; each
needs the llm-blender package or a remote API, so the command refuses ``--judge`` and names these options instead.

Example:
    ```bash
    torchlike xpo --model_name_or_path trl-lib/pythia-1b-deduped-tldr-sft --dataset_name trl-lib/tldr \\
        --reward_model_path trl-lib/pythia-1b-deduped-tldr-rm --learning_rate 5.0e-7 --max_new_tokens 64 \\
        --missing_eos_penalty 1.0 --output_dir pythia-1b-tldr-xpo
    ```
"""

from __future__ import annotations

from typing import Any

from torchlike.trl.experimental.xpo.xpo_config import XPOConfig
from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, TrlParser
from torchlike.trl.scripts.common import run_ranked_online_script
from torchlike.trl.scripts.grpo import GRPOScriptArguments, load_reward_funcs
from torchlike.trl.scripts.online_dpo import OnlineDPOScriptArguments


def make_parser(prog: str | None = None) -> TrlParser:
    """The XPO script's parser: ``OnlineDPOScriptArguments`` (``ScriptArguments`` plus ``--reward_funcs``),
    ``XPOConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((OnlineDPOScriptArguments, XPOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: OnlineDPOScriptArguments, training_args: XPOConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``XPOTrainer`` (ranked by ``--reward_model_path`` or ``--reward_funcs``) and save the model to
    ``output_dir``; returns the trainer.

    Raises:
        ValueError: a ``--judge``, or not exactly one reward.
    """
    from torchlike.trl.experimental.xpo.xpo_trainer import XPOTrainer

    reward_funcs = load_reward_funcs(GRPOScriptArguments(reward_model_name_or_path=training_args.reward_model_path,
                                                         reward_funcs=script_args.reward_funcs))
    return run_ranked_online_script(XPOTrainer, script_args, training_args, model_args, dataset_args, reward_funcs)


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
