"""The TRL trainers' data preparation: each trainer's rows tokenised, masked, packed and collated as TRL's are
(``sft_data``, ``dpo_data``, ``kto_data``, ``reward_data``, ``prompt_data``, ``packing``), and the vision-language
collators (``sft_vision``, ``dpo_vision``, ``prompt_vision``)."""
