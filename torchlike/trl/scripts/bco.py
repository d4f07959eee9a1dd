"""``torchlike bco``: binary classifier optimisation from the command line, as TRL 1.0.0's
``examples/scripts/bco.py`` runs ``trl.experimental.bco``.

The dataset is an unpaired preference one (``prompt``/``completion``/``label``). TRL's script always fits BCO's
underlying distribution matching (UDM) on prompt embeddings from ``nomic-ai/nomic-embed-text-v1.5`` (tokenised by
``bert-base-uncased``); here UDM is on when ``--embedding_model_name_or_path`` names a ``transformers`` encoder, so
the command runs offline and without remote code by default. Its embeddings are TRL's: the last hidden states
mean-pooled over the prompt, L2-normalised, layer-normalised and cut to their first 512 dimensions. UDM needs
scikit-learn and joblib.

Example:
    ```bash
    torchlike bco --model_name_or_path nnheui/stablelm-2-1_6b-sft-full --dataset_name trl-lib/kto-mix-14k \\
        --embedding_model_name_or_path nomic-ai/nomic-embed-text-v1.5 \\
        --embedding_tokenizer_name_or_path bert-base-uncased --trust_remote_code \\
        --per_device_train_batch_size 16 --learning_rate 1e-6 --max_length 2048 --output_dir bco-aligned-model
    ```
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from torchlike.trl.experimental.bco.bco_config import BCOConfig
from torchlike.trl.script_utils import DatasetMixtureConfig, ModelConfig, ScriptArguments, TrlParser
from torchlike.trl.scripts.common import run_training_script

if TYPE_CHECKING:
    import torch

#: How many leading dimensions of the normalised embedding UDM reads (TRL's script's ``matryoshka_dim``).
EMBEDDING_DIMENSIONS = 512


@dataclass
class BCOScriptArguments(ScriptArguments):
    """``ScriptArguments`` plus the embedding model of UDM and TRL 1.0.0's ``--trust_remote_code``.

    Args:
        embedding_model_name_or_path: the encoder whose prompt embeddings UDM classifies (``None``: no UDM).
        embedding_tokenizer_name_or_path: its tokenizer (``None``: the encoder's own).
        trust_remote_code: run the Hub code of the model, tokenizers and encoder (a ``ModelConfig`` flag in TRL
            1.0.0, which BCO's script reads; ``BCOConfig`` has no such field).
    """

    embedding_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Encoder embedding the prompts for underlying distribution matching (UDM); TRL's script "
                          "uses 'nomic-ai/nomic-embed-text-v1.5'. Unset: no UDM."},
    )
    embedding_tokenizer_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Tokenizer of the embedding model (TRL's script: 'bert-base-uncased'); unset: the "
                          "embedding model's own."},
    )
    trust_remote_code: bool = field(
        default=False,
        metadata={"help": "Trust the Hub code of the model, its tokenizer and the embedding model."},
    )


def embed_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, model: torch.nn.Module) -> torch.Tensor:
    """TRL's script's prompt embedding: the encoder's last hidden states averaged over the unmasked tokens,
    L2-normalised, layer-normalised, and cut to their first :data:`EMBEDDING_DIMENSIONS` dimensions.

    Args:
        input_ids: ``[B, L]`` token ids of the prompts.
        attention_mask: ``[B, L]``, 1 on the prompts' tokens.
        model: a ``transformers`` encoder whose first output is ``[B, L, D]`` hidden states.

    Returns:
        ``[B, min(D, EMBEDDING_DIMENSIONS)]`` float embeddings.
    """
    import torch

    with torch.no_grad():
        hidden = model(input_ids=input_ids, attention_mask=attention_mask)[0]
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
    pooled = torch.nn.functional.layer_norm(pooled, normalized_shape=(pooled.shape[1],))
    return pooled[:, :EMBEDDING_DIMENSIONS]


def make_parser(prog: str | None = None) -> TrlParser:
    """The BCO script's parser: ``BCOScriptArguments``, ``BCOConfig``, ``ModelConfig``, ``DatasetMixtureConfig``."""
    return TrlParser((BCOScriptArguments, BCOConfig, ModelConfig, DatasetMixtureConfig), prog=prog)


def main(script_args: BCOScriptArguments, training_args: BCOConfig, model_args: ModelConfig,
         dataset_args: DatasetMixtureConfig) -> Any:
    """Train with ``BCOTrainer`` (the tokenizer of ``--model_name_or_path``, padding with its end token when it has
    no pad token, as TRL's script; UDM when ``--embedding_model_name_or_path`` is set, the encoder run in float32 by
    torch on the CPU) and save the model to ``output_dir``; returns the trainer."""
    from torchlike import AutoTokenizer
    from torchlike.trl.experimental.bco.bco_trainer import BCOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, revision=model_args.model_revision,
                                              trust_remote_code=script_args.trust_remote_code)
    if tokenizer.pad_token is None:  # as TRL's script
        tokenizer.pad_token = tokenizer.eos_token
    udm: dict[str, Any] = {}
    if script_args.embedding_model_name_or_path is not None:
        import torch
        import transformers

        encoder = transformers.AutoModel.from_pretrained(script_args.embedding_model_name_or_path,
                                                         trust_remote_code=script_args.trust_remote_code,
                                                         dtype=torch.float32).eval()
        tokenizer_path = script_args.embedding_tokenizer_name_or_path or script_args.embedding_model_name_or_path
        udm = {"embedding_func": partial(embed_prompts, model=encoder),
               "embedding_tokenizer": transformers.AutoTokenizer.from_pretrained(
                   tokenizer_path, trust_remote_code=script_args.trust_remote_code)}
    return run_training_script(BCOTrainer, script_args, training_args, model_args, dataset_args,
                               trust_remote_code=script_args.trust_remote_code, processing_class=tokenizer, **udm)


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config(fail_with_unknown_args=False))
