"""Train and eval steps (:mod:`.train_step`), step metrics (:mod:`.step_metrics`) and the reference policy a trainer
reads (:mod:`.reference_policy`, :mod:`.reference_sync`)."""
