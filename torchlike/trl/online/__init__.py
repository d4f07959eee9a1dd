"""The online trainers' parts: the rollout worker and its rollouts (``rollout_worker``, ``rollouts``), the reward
scorer and reward models (``reward_scorer``, ``reward_models``), agent environments and tool calling
(``environments``, ``tool_calling``) and the adaptive entropy controller (``entropy_control``). None imports one
algorithm's modules."""
