"""``SDFTTrainer``: TRL 1.16's ``trl.experimental.sdft.SDFTTrainer`` (SDFT, "Self-Distillation Enables Continual
Learning") on torchlike's self-distillation loop
(:class:`~torchlike.trl.experimental.self_distillation_trainer.SelfDistillationTrainer`).

Each generation batch samples ``num_generations`` completions of each prompt with the student (after the student
prompt, or the teacher prompt with ``generate_from_teacher``), as GRPO's schedule does (``steps_per_generation``
micro-batches, ``num_iterations`` passes). The teacher reads the same completion after the teacher prompt, which
``teacher_prompt_template`` builds from the prompt and the row's ``privileged_context``; the student is trained to
match the teacher's next-token distributions on the completion (``adapters.losses.self_distillation``). The teacher
is the initial student (``"base"``: a frozen copy, or with a LoRA adapter the student with its adapter off), the
current student without gradient (``"live"``), or a copy moved towards the student every ``teacher_sync_steps``
optimizer steps (``"ema"``). Student and teacher run in one jitted step (``StudentTeacher``). What SDFT decides on
the loop (the prompt columns, a generation's columns, the loss) is :class:`SDFT`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ....adapters.losses.self_distillation import SelfDistillationLossSettings, self_distillation_step_loss
from ..self_distillation_trainer import (
    SelfDistillationAlgorithm,
    SelfDistillationTrainer,
    SyncTeacherModelCallback,
    message_text,
)
from .sdft_config import SDFTConfig

__all__ = ["SDFT", "SDFTTrainer", "SyncTeacherModelCallback"]


def stringified_context(privileged_context: Any) -> str:  # Any: text, messages or any value str() renders
    """TRL's ``_stringify_privileged_context``: text as it is, messages as their text contents joined by newlines,
    anything else ``str()``.

    Raises:
        ValueError: ``None`` (TRL's message).
    """
    if privileged_context is None:
        raise ValueError("`privileged_context` must not be None for self-distillation teacher prompt construction.")
    if isinstance(privileged_context, str):
        return privileged_context
    if isinstance(privileged_context, list) and privileged_context and isinstance(privileged_context[0], dict):
        chunks = [message_text(message) for message in privileged_context]
        return "\n".join(chunk for chunk in chunks if chunk)
    return str(privileged_context)


def teacher_prompt(prompt: str | list[dict], privileged_context: Any,  # Any: as stringified_context takes it
                   template: str) -> str | list[dict]:
    """TRL's ``_compose_teacher_prompt``: ``template`` formatted with the prompt and the privileged context; for a
    conversation, the last user turn's text is formatted and replaces that turn.

    Raises:
        ValueError: a conversation that does not end with a user turn (TRL's message).
    """
    context = stringified_context(privileged_context)
    if isinstance(prompt, list):
        last = prompt[-1]
        if last.get("role") != "user":
            raise ValueError("Self-distillation teacher prompt construction expects the conversation to end with a "
                             f"user turn, but the last message has role '{last.get('role')}'. Prompts ending with "
                             "assistant prefills or tool turns are not supported.")
        text = template.format(prompt=message_text(last), privileged_context=context)
        return [*prompt[:-1], {"role": "user", "content": text}]
    return template.format(prompt=prompt, privileged_context=context)


class SDFT(SelfDistillationAlgorithm):
    """TRL 1.16's SDFT on the self-distillation loop: the teacher prompt built from each row's ``privileged_context``
    (``teacher_prompt_template``), the completions sampled after the student prompt (or the teacher prompt with
    ``generate_from_teacher``) and the self-distillation loss
    (:func:`adapters.losses.self_distillation.self_distillation_step_loss`)."""

    metric_prefix = "sdft"

    def prompt_columns(self, row: dict) -> dict[str, list[int]]:
        """The token columns of one row: ``student_prompt_ids``, ``teacher_prompt_ids`` and ``prompt_ids`` (the
        prompt sampled from)."""
        trainer = self.trainer
        student = trainer._prompt_token_ids(row["prompt"])
        teacher = trainer._prompt_token_ids(teacher_prompt(row["prompt"], row.get("privileged_context"),
                                                           trainer.args.teacher_prompt_template))
        return {"student_prompt_ids": student, "teacher_prompt_ids": teacher,
                "prompt_ids": teacher if trainer.args.generate_from_teacher else student}

    def step_loss(self) -> tuple[Callable, None]:
        """The self-distillation loss (:func:`adapters.losses.self_distillation.self_distillation_step_loss`)."""
        trainer = self.trainer
        settings = SelfDistillationLossSettings.from_config(trainer.args, teacher_lora=trainer._teacher_lora,
                                                            metric_prefix=self.metric_prefix)
        return self_distillation_step_loss(trainer.model.family, trainer.model.family, settings), None

    @property
    def keeps_rollout_log_probs(self) -> bool:
        """TRL's rule: the student's log-probabilities at sampling time are kept (for the importance weights) when
        the weights change within a generation batch's steps and sampling used the student prompt."""
        args = self.trainer.args
        return not args.generate_from_teacher and \
            args.gradient_accumulation_steps % (args.steps_per_generation * args.num_iterations) != 0

    def generation_columns(self, rows: list[dict], seed: int, prefix: str) -> dict[str, np.ndarray]:
        """A generation's step columns (see ``adapters.losses.self_distillation``): the student's completions, after
        the student prompt and after the teacher prompt, with the loss mask, and the rollout log-probabilities when
        they are kept; its completion metrics join the next log (``prefix`` ``"eval_"`` in evaluation)."""
        trainer = self.trainer
        record = trainer._generate(rows, seed)
        trainer._record_completion_metrics(record, prefix, train=not prefix)
        width = record.tokens.shape[1]
        loss_mask = record.completion_mask * (np.arange(width) >= trainer.args.num_loss_tokens_to_skip)
        columns = {"completion_ids": record.tokens, "loss_mask": loss_mask.astype(np.int32)}
        for key, prefix_name in (("student_prompt_ids", ""), ("teacher_prompt_ids", "teacher_")):
            ids, mask = trainer._prompts(rows, key)
            columns[f"{prefix_name}input_ids"] = np.concatenate([ids, record.tokens], axis=1)
            columns[f"{prefix_name}attention_mask"] = np.concatenate([mask, record.completion_mask], axis=1)
        if self.keeps_rollout_log_probs:
            columns["old_logps"] = trainer._rollout_log_probs(columns, record)
        return {key: np.ascontiguousarray(value) for key, value in columns.items()}


class SDFTTrainer(SelfDistillationTrainer):
    """``trl.experimental.sdft.SDFTTrainer`` with TRL 1.16's signature, training a torchlike model on a JAX mesh.

    Args:
        model: a :class:`~torchlike.CausalLM` (or ``PeftModel``), a ``transformers`` model object (converted: the
            same weights, dtype and ``name_or_path``), or a path / hub id loaded with ``args.model_init_kwargs``.
        args: :class:`SDFTConfig` (default: one with ``output_dir="<model>-SDFT"``).
        train_dataset: rows with a ``prompt`` (text or chat messages ending with a user turn) and a
            ``privileged_context`` (text, messages or any value ``str()`` renders) the teacher prompt adds.
        eval_dataset: the same kind of rows, or a dict of such datasets.
        processing_class: the tokenizer (default: loaded from the model's path); without a pad token its eos token
            pads.
        callbacks: ``transformers.TrainerCallback`` objects (or classes).
        optimizers: ``(optax transformation, None)`` to replace the AdamW built from ``args``.
        peft_config: a :class:`~torchlike.peft.LoraConfig`: train a new LoRA adapter.

    Raises:
        NotImplementedError: an ``IterableDataset`` (TRL's message).
        ValueError: no ``train_dataset``, no ``prompt`` column, or a row TRL cannot build a teacher prompt for.

    Example:

    ```python
    >>> from torchlike.trl.experimental.sdft import SDFTConfig, SDFTTrainer
    >>> rows = [{"prompt": "Capital of France?", "privileged_context": "The answer is Paris."}] * 64
    >>> trainer = SDFTTrainer(model="path/to/Qwen2.5-0.5B-Instruct", train_dataset=rows,
    ...                       args=SDFTConfig("out", num_generations=4, max_completion_length=64))
    >>> trainer.train()
    ```
    """

    algorithm_class = SDFT
    _config_class = SDFTConfig
    _output_suffix = "SDFT"
    _tag_names = ["trl", "sdft"]
