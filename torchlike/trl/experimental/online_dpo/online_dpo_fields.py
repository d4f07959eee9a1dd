"""What torchlike does with each field ``trl.experimental.online_dpo.OnlineDPOConfig`` adds to ``TrainingArguments``,
and with the ``TrainingArguments`` fields whose meaning online DPO changes.

``OnlineDPOConfig._FIELD_SUPPORT`` is this table, laid over ``TrainingArguments``' (see :mod:`torchlike.field_support`);
the sampling and vLLM rows it shares with GRPO are GRPO's. A test holds it against the fields of the real
``trl.experimental.online_dpo.OnlineDPOConfig``.
"""

from __future__ import annotations

from ....field_support import FieldSupport, honoured, refused
from ...trainer.grpo_fields import GRPO_FIELD_SUPPORT

ONLINE_DPO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    "neftune_noise_alpha": GRPO_FIELD_SUPPORT["neftune_noise_alpha"],
    # --- TrainingArguments fields whose meaning online DPO changes ---
    "per_device_train_batch_size": honoured("Prompts per data-parallel shard and micro-batch, as in TRL: each is "
                                            "sampled twice, so a micro-batch trains on twice as many completions "
                                            "(one chosen, one rejected per prompt). An epoch's last partial "
                                            "batch (and a partial accumulation window) is dropped, where TRL "
                                            "trains on it."),
    "gradient_accumulation_steps": honoured("Micro-batches per optimizer step, each sampled with the weights of the "
                                            "steps before it. As TRL (its training_step back-propagates each "
                                            "micro-batch's mean loss undivided), the gradients of the window are "
                                            "summed, not averaged, and the logged loss is the window's mean."),
    "remove_unused_columns": refused("TRL's Trainer would drop the prompt column (no argument of the model's "
                                     "forward), leaving nothing to generate from; OnlineDPOConfig's default False "
                                     "is the setting that trains. With it every dataset column but prompt reaches "
                                     "the reward functions as a keyword list, as in TRL."),
    "eval_strategy": refused("TRL's OnlineDPOTrainer has no evaluation of its own: transformers' prediction_step "
                             "calls the model on the collated prompt batch, which fails. torchlike refuses "
                             "evaluation rather than invent one; sample and score held-out prompts yourself."),
    # --- model ---
    "model_init_kwargs": honoured("Keyword arguments for torchlike.AutoModelForCausalLM.from_pretrained when model is "
                                  "a string; with a model already loaded, TRL's ValueError."),
    "trust_remote_code": GRPO_FIELD_SUPPORT["trust_remote_code"],
    "disable_dropout": GRPO_FIELD_SUPPORT["disable_dropout"],
    # --- rewards ---
    "reward_model_path": honoured("As in TRL, the trainer does not read it (it takes reward_funcs); the torchlike "
                                  "online_dpo command loads it as the reward model, as TRL's example script does."),
    "reward_weights": honoured("Weight of each reward function in the NaN-skipping sum of rewards (default 1.0 "
                               "each), as TRL's _calculate_rewards_from_functions."),
    "missing_eos_penalty": honoured("Subtracted from the reward of every completion without an end token (TRL's "
                                    "contain_eos_token: any end token among its generated tokens), before the two "
                                    "completions of a prompt are ranked."),
    # --- loss ---
    "beta": honoured("The DPO temperature (IPO's tau) of the loss, rewards/* metrics and the KL penalty of the "
                     "objective/* metrics. A list gives the beta of each epoch (the last one for the epochs after "
                     "it), as TRL's documentation says; TRL 1.16 itself indexes the list with the fractional "
                     "state.epoch and fails after the first step, torchlike uses the epoch's index."),
    "loss_type": honoured("'sigmoid': -log sigmoid(beta x margin); 'ipo': (margin - 1 / (2 beta))**2, not length "
                          "normalised (unlike DPOTrainer's ipo), as TRL's online trainer "
                          "(torchlike.adapters.losses.online_dpo); anything else raises TRL's NotImplementedError, "
                          "at construction instead of the first step."),
    # --- data and generation ---
    "max_new_tokens": honoured("Generation stops after this many tokens or at an end token (kept); the loss masks "
                               "the tokens after it, as TRL's truncate_right."),
    "max_length": honoured("When a micro-batch's longest prompt plus longest completion exceed it, the prompts lose "
                           "that many leftmost columns, as TRL's _forward (a batch whose prompts would vanish "
                           "entirely is refused: TRL then scores each token with its own position's logits)."),
    "temperature": honoured("Sampling temperature; as in TRL the loss reads the untempered log-probabilities."),
    "top_p": GRPO_FIELD_SUPPORT["top_p"],
    "top_k": GRPO_FIELD_SUPPORT["top_k"],
    "min_p": GRPO_FIELD_SUPPORT["min_p"],
    "repetition_penalty": GRPO_FIELD_SUPPORT["repetition_penalty"],
    "generation_kwargs": GRPO_FIELD_SUPPORT["generation_kwargs"],
    "cache_implementation": GRPO_FIELD_SUPPORT["cache_implementation"],
    "ds3_gather_for_generation": GRPO_FIELD_SUPPORT["ds3_gather_for_generation"],
    # --- vLLM ---
    "use_vllm": GRPO_FIELD_SUPPORT["use_vllm"],
    "vllm_model_impl": GRPO_FIELD_SUPPORT["vllm_model_impl"],
    "vllm_enable_sleep_mode": GRPO_FIELD_SUPPORT["vllm_enable_sleep_mode"],
    "vllm_gpu_memory_utilization": GRPO_FIELD_SUPPORT["vllm_gpu_memory_utilization"],
    "vllm_tensor_parallel_size": GRPO_FIELD_SUPPORT["vllm_tensor_parallel_size"],
    "vllm_structured_outputs_regex": GRPO_FIELD_SUPPORT["vllm_structured_outputs_regex"],
    "vllm_mode": GRPO_FIELD_SUPPORT["vllm_mode"],
    "vllm_server_base_url": GRPO_FIELD_SUPPORT["vllm_server_base_url"],
    "vllm_server_host": GRPO_FIELD_SUPPORT["vllm_server_host"],
    "vllm_server_port": GRPO_FIELD_SUPPORT["vllm_server_port"],
    "vllm_server_timeout": GRPO_FIELD_SUPPORT["vllm_server_timeout"],
    "vllm_group_port": GRPO_FIELD_SUPPORT["vllm_group_port"],
}
