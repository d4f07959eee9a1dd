"""``torchlike nash_md``: Nash mirror descent from the command line, as TRL 1.0.0's
``examples/scripts/nash_md.py`` runs ``trl.experimental.nash_md``.

One reward ranks each prompt's two completions (the policy's and the one sampled from its mixture with the
reference): a reward model (``--reward_model_path``, a ``NashMDConfig`` field) or one reward function
(``--reward_funcs``, TRL's registry names or a dotted import path, as in ``torchlike online_dpo``). TRL's script also
offers ``--judge pair_rm|openai|hf``; each needs the llm-blender package or a remote API, so the command refuses
``--judge`` and names these options instead.

Example:
    ```bash
    torchlike nash_md --model_name_or_path trl-lib/pythia-1b-deduped-tldr-sft --dataset_name trl-lib/tldr \\
        --reward_model_path trl-lib/pythia-1b-deduped-tldr-rm --learning_rate 5.0e-7 --max_new_tokens 64 \\
        --missing_eos_penalty 1.0 --output_dir pythia-1b-tldr-nash-md
    ```
"""

from __future__ import annotations

from typing import Any

from torchlike.trl.experimental.nash_md.nash_md_config import NashMDConfig
from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, TrlParser
from torchlike.trl.scripts.common import run_ranked_online_script
from torchlike.trl.scripts.grpo import GRPOScriptArguments, load_reward_funcs
from torchlike.trl.scripts.online_dpo import OnlineDPOScriptArguments


def make_parser(prog: str | None = None) -> TrlParser:
    """The Nash-MD script's parser: ``OnlineDPOScriptArguments`` (``ScriptArguments`` plus ``--reward_funcs``),
    ``NashMDConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((OnlineDPOScriptArguments, NashMDConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: OnlineDPOScriptArguments, training_args: NashMDConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``NashMDTrainer`` (ranked by ``--reward_model_path`` or ``--reward_funcs``) and save the model to
    ``output_dir``; returns the trainer.

    Raises:
        ValueError: a ``--judge``, or not exactly one reward.
    """
    from torchlike.trl.experimental.nash_md.nash_md_trainer import NashMDTrainer

    reward_funcs = load_reward_funcs(GRPOScriptArguments(reward_model_name_or_path=training_args.reward_model_path,
                                                         reward_funcs=script_args.reward_funcs))
    return run_ranked_online_script(NashMDTrainer, script_args, training_args, model_args, dataset_args, reward_funcs)


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
