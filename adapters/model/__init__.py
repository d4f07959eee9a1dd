"""The model: building, filling, reading and running Tunix modules (:mod:`.tunix_model`), the weight plan
(:mod:`.weight_plan`), the NNX state walker (:mod:`.nnx_state`), rope (:mod:`.rope`), the classification head
(:mod:`.sequence_classification`), per-family habits (:mod:`.model_habits`), prompt learning (:mod:`.prompt_learning`)
and NEFTune (:mod:`.neftune`)."""
