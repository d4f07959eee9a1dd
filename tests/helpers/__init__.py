"""What the tests share, by job; a test module imports from here (or takes a conftest fixture), never from another
test module.

- :mod:`tests.helpers.config_fields`: comparing a torchlike config with its transformers/TRL dataclass field by field,
  and the warnings its unsupported fields emit.
- :mod:`tests.helpers.logs`: reading a trainer's ``log_history`` and its evaluation metrics.
- :mod:`tests.helpers.models`: tiny models' logits against transformers', checkpoint copies, LoRA factors, classifiers.
- :mod:`tests.helpers.tokenizers`: the tests' tokenizer as a trainer's ``processing_class``, its chat template.
- :mod:`tests.helpers.data`: the small datasets several trainers' tests train on.
- :mod:`tests.helpers.scripts`: TRL's ``trl/scripts`` ported to torchlike and their command lines.
- :mod:`tests.helpers.training`: the ``TrainingArguments`` of short ``Trainer`` runs, the default-config SFT run.
- :mod:`tests.tiny`: the tiny random checkpoints by case name, padded batches, and the TRL comparisons of the
  online (GRPO/RLOO on scripted completions) and pairwise (ORPO/CPO) trainers.

Shared fixtures (``tiny_checkpoints``, ``tokenizer_dir``, ``tokenizer``, ``script_model``, ``padded_batch``,
``rematerialised_modules``) are in ``tests/conftest.py``.
"""
