"""``SFTConfig``: TRL 1.16's supervised fine-tuning configuration, field for field, on ``TrainingArguments``.

It adds TRL's SFT fields and TRL's changed defaults (``learning_rate=2e-5``, ``logging_steps=10``,
``gradient_checkpointing=True``, ``bf16=None`` -> ``True`` unless ``fp16``) to ``torchlike.TrainingArguments``, and
normalises values as TRL's ``__post_init__`` does. Unlike TRL, the bf16 default also works on a CPU. What the trainer
does with each field is in ``torchlike.trl.trainer.sft_fields.SFT_FIELD_SUPPORT``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchlike.adapters.losses.sft import SFT_LOSS_TYPES as LOSS_TYPES
from torchlike.training_args import TrainingArguments, check_choice, reject_removed_arguments, warn_from_config
from torchlike.trl.trainer.sft_fields import SFT_FIELD_SUPPORT

#: ``truncation_mode`` values (``"keep_end"`` is deprecated in TRL and warns).
TRUNCATION_MODES: tuple[str, ...] = ("keep_start", "keep_end")
# ``LOSS_TYPES`` (``"chunked_nll"`` is TRL's deprecated alias of ``"nll"``) is the loss module's table
# (torchlike.adapters.losses.sft).
#: ``packing_strategy`` values (``"bfd-requeue"`` is TRL's deprecated name of ``"bfd_split"``).
PACKING_STRATEGIES: tuple[str, ...] = ("bfd", "bfd_split", "wrapped")

_REMOVED_SFT_ARGUMENTS: dict[str, str] = {
    "max_seq_length": "TRL renamed it `max_length` (TRL 0.16); pass max_length instead",
}


@dataclass
class SFTConfig(TrainingArguments):
    """Configuration of ``torchlike.trl.SFTTrainer``, with TRL 1.16 ``SFTConfig``'s fields and defaults.

    All ``TrainingArguments`` fields apply. TRL changes four defaults: ``learning_rate=2e-5``, ``logging_steps=10``,
    ``gradient_checkpointing=True`` and ``bf16=None`` (becomes ``True`` unless ``fp16=True``). TRL refuses that bf16
    default on a machine without a bf16 GPU unless ``use_cpu=True``; torchlike runs bf16 compute on CPUs too.

    Args:
        model_init_kwargs (`dict` or JSON `str`, *optional*): keyword arguments for
            ``torchlike.AutoModelForCausalLM.from_pretrained`` when ``model`` is a string (``dtype`` as a string,
            a torch dtype or ``"auto"``).
        trust_remote_code (`bool`, defaults to `False`): must stay ``False``: Hub modelling code is PyTorch.
        router_aux_loss_coef (`float`, *optional*): MoE load-balancing loss weight; torchlike's families are dense.
        chat_template_path (`str`, *optional*): a tokenizer directory/id or a ``.jinja`` file whose chat template
            replaces the tokenizer's.
        dataset_text_field (`str`, defaults to ``"text"``): column holding the text of language-modelling data.
        dataset_kwargs (`dict`, *optional*): only ``skip_prepare_dataset`` is read (other keys warn, as TRL ignores
            them).
        dataset_num_proc (`int`, *optional*): processes for ``datasets.Dataset.map`` during preparation.
        eos_token (`str`, *optional*): end-of-sequence/turn token appended to examples; the tokenizer's by default.
        max_length (`int` or `None`, defaults to 1024): examples longer than this are truncated; ``None`` keeps
            them whole. Batches are padded to the longest prepared example.
        truncation_mode (`str`, defaults to ``"keep_start"``): ``"keep_start"`` or the deprecated ``"keep_end"``.
        shuffle_dataset (`bool`, defaults to `False`): shuffle the prepared dataset once, seeded by ``seed``.
        packing (`bool`, defaults to `False`): pack examples into rows of ``max_length`` tokens; each packed
            sequence keeps its own positions and attends only to itself.
        packing_strategy (`str`, defaults to ``"bfd"``): ``"bfd"`` (best fit decreasing, long sequences truncated),
            ``"bfd_split"`` (long sequences split) or ``"wrapped"`` (concatenate and cut; sequences see each other
            unless ``padding_free``); only read with ``packing=True``.
        padding_free (`bool`, defaults to `False`): TRL's padding-free batches (forced on by ``"bfd"`` packing): each
            sequence has its own positions and the first token of each is not a target; without packing TRL
            requires ``max_length=None``.
        pad_to_multiple_of (`int`, `"auto"` or `None`): round padded lengths up to a multiple of this; ``"auto"``
            becomes ``None`` as in TRL off Neuron (torchlike pads to fixed shapes either way).
        eval_packing (`bool`, *optional*): pack the evaluation data; ``None``: as ``packing``.
        completion_only_loss (`bool`, *optional*): loss on completion tokens only; ``None`` means yes for
            prompt-completion data, no for language-modelling data.
        assistant_only_loss (`bool`, defaults to `False`): loss on assistant turns only (conversational data and a
            chat template with ``{% generation %}`` markers).
        loss_type (`str`, defaults to ``"nll"``): ``"nll"`` (``"chunked_nll"`` is TRL's deprecated alias) or ``"dft"``
            (Dynamic Fine-Tuning: each token's NLL weighted by its detached probability).
        activation_offloading (`bool`, defaults to `False`): not implemented; use ``gradient_checkpointing``.
        pad_token (`str`, *optional*): deprecated in TRL; sets the tokenizer's pad token.
    """

    _VALID_DICT_FIELDS = (*TrainingArguments._VALID_DICT_FIELDS, "model_init_kwargs", "dataset_kwargs")
    _FIELD_SUPPORT = SFT_FIELD_SUPPORT

    # --- TrainingArguments defaults TRL changes ---
    logging_steps: float = 10
    gradient_checkpointing: bool = True
    bf16: bool | None = None
    learning_rate: float = 2e-5

    # --- model ---
    model_init_kwargs: dict[str, Any] | str | None = None
    trust_remote_code: bool = False
    router_aux_loss_coef: float | None = None
    chat_template_path: str | None = None

    # --- data preprocessing ---
    dataset_text_field: str = "text"
    dataset_kwargs: dict[str, Any] | str | None = None
    dataset_num_proc: int | None = None
    eos_token: str | None = None
    max_length: int | None = 1024
    truncation_mode: str = "keep_start"
    shuffle_dataset: bool = False
    packing: bool = False
    packing_strategy: str = "bfd"
    padding_free: bool = False
    pad_to_multiple_of: int | str | None = "auto"
    eval_packing: bool | None = None

    # --- training ---
    completion_only_loss: bool | None = None
    assistant_only_loss: bool = False
    loss_type: str = "nll"
    activation_offloading: bool = False

    # --- deprecated ---
    pad_token: str | None = None

    def __post_init__(self) -> None:
        self.bf16 = (not self.fp16) if self.bf16 is None else self.bf16
        super().__post_init__()

        if isinstance(self.pad_to_multiple_of, str) and self.pad_to_multiple_of != "auto":
            text = self.pad_to_multiple_of.strip().lower()
            if text in ("none", "null"):
                self.pad_to_multiple_of = None
            elif text.isdigit():
                self.pad_to_multiple_of = int(text)
            else:
                raise ValueError(f"pad_to_multiple_of={self.pad_to_multiple_of!r}: expected a positive integer, "
                                 "'auto' or None.")
        if self.pad_to_multiple_of == "auto":
            # TRL pads to 128 only on Neuron; torchlike already pads every batch to a fixed bucket.
            self.pad_to_multiple_of = None
        if self.pad_to_multiple_of is not None and (not isinstance(self.pad_to_multiple_of, int)
                                                    or self.pad_to_multiple_of < 1):
            raise ValueError(f"pad_to_multiple_of={self.pad_to_multiple_of!r}: expected a positive integer, 'auto' "
                             "or None.")
        if self.max_length is not None and (not isinstance(self.max_length, int) or self.max_length < 1):
            raise ValueError(f"max_length={self.max_length!r}: expected a positive integer, or None for no "
                             "truncation.")

        if self.loss_type == "chunked_nll":
            warn_from_config("loss_type='chunked_nll' is deprecated in TRL (removal in v2.0.0); using "
                             "loss_type='nll', which computes the same loss.", FutureWarning)
            self.loss_type = "nll"
        self.loss_type = check_choice("loss_type", self.loss_type, LOSS_TYPES)
        self.truncation_mode = check_choice("truncation_mode", self.truncation_mode, TRUNCATION_MODES)
        if self.truncation_mode == "keep_end":
            warn_from_config("truncation_mode='keep_end' is deprecated in TRL (removal in v2.0.0); use "
                             "truncation_mode='keep_start' (the default).", FutureWarning)
        if self.packing_strategy == "bfd-requeue":
            warn_from_config("packing_strategy='bfd-requeue' was renamed 'bfd_split' in TRL; using 'bfd_split'.",
                             FutureWarning)
            self.packing_strategy = "bfd_split"
        self.packing_strategy = check_choice("packing_strategy", self.packing_strategy, PACKING_STRATEGIES)
        if self.pad_token is not None:
            warn_from_config("pad_token is deprecated in TRL (removal in v2.0.0): set tokenizer.pad_token and pass "
                             "the tokenizer as processing_class instead.", FutureWarning)
        if isinstance(self.dataset_kwargs, dict):
            unknown = sorted(set(self.dataset_kwargs) - {"skip_prepare_dataset"})
            if unknown:
                warn_from_config(f"dataset_kwargs keys {unknown} are ignored: the only key TRL 1.16 and torchlike "
                                 "read is 'skip_prepare_dataset'.", UserWarning)


reject_removed_arguments(SFTConfig, _REMOVED_SFT_ARGUMENTS)
