"""What the tests share, by job; a test module imports from here (or takes a conftest fixture), never from another
test module.

- :mod:`tests.helpers.config_fields`: comparing a torchlike config with its transformers/TRL dataclass field by field.
- :mod:`tests.helpers.logs`: reading a trainer's ``log_history`` and capturing the warnings a config emits.
- :mod:`tests.helpers.models`: tiny models' logits against transformers', checkpoint copies, LoRA factors, classifiers.
- :mod:`tests.helpers.tokenizers`: the tests' tokenizer as a trainer's ``processing_class``, its chat template.
- :mod:`tests.helpers.data`: the small datasets several trainers' tests train on.
- :mod:`tests.helpers.scripts`: TRL's ``trl/scripts`` ported to torchlike and their command lines.
- :mod:`tests.tiny`: the tiny random checkpoints by case name, padded batches and the scripted GRPO/pairwise runs.
"""
