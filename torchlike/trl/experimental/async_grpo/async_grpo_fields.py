"""What torchlike does with each field ``trl.experimental.async_grpo.AsyncGRPOConfig`` adds to ``TrainingArguments``,
and with the ``TrainingArguments`` fields whose meaning AsyncGRPO changes.

``AsyncGRPOConfig._FIELD_SUPPORT`` is this table, laid over ``TrainingArguments``' (see :mod:`torchlike.field_support`);
fields with GRPO's meaning reuse ``GRPO_FIELD_SUPPORT``'s rows. A test holds it against the fields of the real class.
TRL samples through a vLLM server in a child process; torchlike samples with its own engine in the training process
(the paged engine's stream samples ahead while the trainer trains), so the server's fields have nothing to act on.
"""

from __future__ import annotations

from ....field_support import FieldSupport, honoured, ignored, refused
from ...trainer.grpo_fields import GRPO_FIELD_SUPPORT

_NO_SERVER = ("Accepted and not used: TRL's AsyncGRPO talks to a vLLM server (generation requests, weight transfers, "
              "a rollout worker process); torchlike samples with its own engine in the training process, so there is "
              "no server, request, transfer or worker process for this setting to time or address.")
_STREAM_ONLY = ("torchlike tags the tokens with weight versions on the paged engine's stream (rollout_engine='paged', "
                "one process); elsewhere a setting that would leave stale samples untagged is refused at the "
                "trainer's start.")

ASYNC_GRPO_FIELD_SUPPORT: dict[str, FieldSupport] = {
    # --- TrainingArguments fields whose meaning AsyncGRPO changes ---
    "per_device_train_batch_size": honoured("Completions per micro-batch per data-parallel shard (TRL's fixed-count "
                                            "batching, token_budget <= 0); an optimizer step trains it x shards x "
                                            "gradient_accumulation_steps completions (TRL's samples per step), "
                                            "sampled as one generation batch of whole prompt groups, so that count "
                                            "must be a multiple of num_generations (an error names the values that "
                                            "work; TRL lets a group straddle steps)."),
    "gradient_accumulation_steps": honoured("Micro-batches per optimizer step; each micro-batch's loss is its token "
                                            "sum over its own completion tokens, divided by the accumulation steps, "
                                            "as TRL's compute_loss (by the micro-batches that kept completions when "
                                            "stale ones were dropped)."),
    "ignore_data_skip": honoured("True (TRL's default, which TRL forces): the Trainer's skip-and-replay is not used. "
                                 "Resuming restores the data position saved in the checkpoint (TRL's "
                                 "rollout_state.json prompt_index does the same); False warns and is set to True, as "
                                 "TRL does."),
    "remove_unused_columns": honoured("Has no effect, as in TRL's AsyncGRPO, whose rollout worker passes every dataset "
                                      "column except prompt to the reward functions: the trainer sets it to False."),
    "auto_find_batch_size": refused("Generation batches hold whole prompt groups of num_generations completions, "
                                    "which retrying with a smaller batch after running out of memory would break; set "
                                    "per_device_train_batch_size yourself."),
    "neftune_noise_alpha": refused("TRL applies NEFTune in the training forward through its Trainer; torchlike's "
                                   "policy-gradient step does not add the noise, so the field is refused rather than "
                                   "silently dropped."),
    "data_seed": ignored("TRL's AsyncGRPO reads the prompts in dataset order and never reads data_seed; torchlike "
                         "does the same."),
    "num_train_epochs": honoured("Passes over the prompts when max_steps is -1: each epoch samples every whole "
                                 "generation batch of prompts once, in dataset order (TRL counts distinct prompt "
                                 "groups trained, which is the same count without tool forks; a last partial batch is "
                                 "dropped)."),
    # --- model ---
    "model_init_kwargs": GRPO_FIELD_SUPPORT["model_init_kwargs"],
    "dtype": honoured("The dtype a model given by path is loaded in ('float32' by default, 'bfloat16', 'float16' or "
                      "'auto'); a dtype in model_init_kwargs wins, as in TRL. bf16 then sets the compute dtype."),
    "trust_remote_code": GRPO_FIELD_SUPPORT["trust_remote_code"],
    "router_aux_loss_coef": GRPO_FIELD_SUPPORT["router_aux_loss_coef"],
    # --- generation ---
    "num_generations": honoured("Completions sampled per prompt; advantages are taken within each group of "
                                "num_generations (one completion per prompt gives advantage 0, as TRL)."),
    "max_completion_length": honoured("Generation stops after this many tokens; with the prompt length it sizes the "
                                      "engine's KV cache (TRL's vLLM max_tokens)."),
    "temperature": GRPO_FIELD_SUPPORT["temperature"],
    "top_p": GRPO_FIELD_SUPPORT["top_p"],
    "top_k": GRPO_FIELD_SUPPORT["top_k"],
    "min_p": GRPO_FIELD_SUPPORT["min_p"],
    "repetition_penalty": GRPO_FIELD_SUPPORT["repetition_penalty"],
    "chat_template_kwargs": GRPO_FIELD_SUPPORT["chat_template_kwargs"],
    "max_tool_calling_iterations": honoured("With tools or an environment_factory: the most rounds of tool calls and "
                                            "continued generation per completion (None: until the model stops "
                                            "calling tools or max_completion_length is reached). Tools run in the "
                                            "training loop (torchlike.trl.online.tool_calling), so those batches "
                                            "are sampled when due, with the current weights (nothing stale)."),
    "fork_threshold_tokens": ignored("TRL's AsyncGRPO re-tokenizes a multi-turn conversation every turn and forks a "
                                     "new training row when the re-tokenization rewrites more than this many trained "
                                     "tokens. torchlike's tool loop never re-tokenizes: each turn's tokens are "
                                     "appended to the one row (TRL GRPOTrainer's way, with a prefix-preserving chat "
                                     "template), so there is no drift to measure and no fork."),
    # --- TRL's vLLM server ---
    "vllm_server_base_url": ignored(_NO_SERVER),
    "vllm_server_timeout": ignored(_NO_SERVER),
    "request_timeout": ignored(_NO_SERVER),
    "weight_sync_timeout": ignored(_NO_SERVER),
    "heartbeat_stale_after_s": ignored(_NO_SERVER + " An error in the engine's thread is raised by the step waiting "
                                                    "for its batch."),
    # --- training ---
    "epsilon": honoured("Lower clip of the ratio of the policy's to the sampler's token probabilities, 1 - epsilon "
                        "(torchlike.adapters.losses.async_grpo)."),
    "epsilon_high": honoured("Upper clip of the ratio, 1 + epsilon_high (None: epsilon)."),
    "token_budget": honoured("torchlike batches by count: each micro-batch holds per_device_train_batch_size "
                             "completions, padded (TRL's token_budget <= 0). None (TRL's default, the server's "
                             "max_model_len) and values <= 0 give that; a positive budget (TRL's token-balanced "
                             "micro-batches of varying size) is refused, as it would change the loss's "
                             "normalisation."),
    # --- the async rollout pipeline ---
    "max_inflight_tasks": honoured("Completions sampled ahead of the batch training, in whole generation batches "
                                   "(rounded up; 0: each batch is sampled when due). -1 (auto): max_staleness "
                                   "generation batches (TRL: max(max_staleness, 1) x samples per step; a sample drawn "
                                   "ahead with max_staleness=0 would be dropped, so torchlike then samples each batch "
                                   "when due). Tools and environments sample in the loop: nothing ahead. "
                                   + _STREAM_ONLY),
    "max_staleness": honoured("A completion whose first token was drawn more than max_staleness weight versions "
                              "before the sampler's current one is dropped when its batch is due: left out of the "
                              "loss and of its micro-batch's token count (scored with its group as it was, as TRL "
                              "scores before dropping), counted in sample/dropped_stale_total; training goes on. "
                              "TRL refills the micro-batch from the queue; torchlike trains the step on the "
                              "completions left: a micro-batch left without any is out of the accumulation's average "
                              "and of the logged loss metrics, and a step whose completions are all dropped has no "
                              "gradient (the optimizer still steps). Kept completions' staleness is logged as "
                              "sample/staleness_mean and _max."),
    "queue_maxsize": honoured("The most completions held sampled ahead and not yet trained on, in whole generation "
                              "batches (<= 0: no bound, as TRL's queue); it caps max_inflight_tasks."),
    "weight_sync_steps": honoured("The sampler gets the policy's weights every weight_sync_steps optimizer steps (and "
                                  "when training starts), each hand-over a new weight version (TRL's model_version, "
                                  "saved in each checkpoint's rollout_state.json and restored on resume); staleness "
                                  "counts versions. " + _STREAM_ONLY),
    # --- logging ---
    "log_completions": GRPO_FIELD_SUPPORT["log_completions"],
    "num_completions_to_print": GRPO_FIELD_SUPPORT["num_completions_to_print"],
    # --- torchlike's rollout engine ---
    "rollout_engine": honoured("torchlike: the engine that samples, 'paged' by default (its stream samples ahead, "
                               "tags each token with the weight version that drew it and takes new weights between "
                               "two decode calls); 'static' or a registered engine samples ahead with a second "
                               "engine in a background thread. 'vllm_server' is refused: it is what torchlike "
                               "replaces."),
    "rollout_max_num_seqs": GRPO_FIELD_SUPPORT["rollout_max_num_seqs"],
    "rollout_page_size": GRPO_FIELD_SUPPORT["rollout_page_size"],
    "rollout_kv_cache_tokens": GRPO_FIELD_SUPPORT["rollout_kv_cache_tokens"],
    "rollout_max_num_batched_tokens": GRPO_FIELD_SUPPORT["rollout_max_num_batched_tokens"],
    "rollout_attention": GRPO_FIELD_SUPPORT["rollout_attention"],
    "rollout_gpu_memory_utilization": GRPO_FIELD_SUPPORT["rollout_gpu_memory_utilization"],
    "rollout_async_scheduling": GRPO_FIELD_SUPPORT["rollout_async_scheduling"],
}
