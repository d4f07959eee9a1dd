"""torchlike.trl.experimental: TRL 1.16's ``trl.experimental`` trainers, and those of TRL 1.0.0 that 1.16 no longer
ships (``xpo``, ``nash_md``, ``bco``), under the same module paths
(``from trl.experimental.orpo import ORPOTrainer`` -> ``from torchlike.trl.experimental.orpo import ORPOTrainer``)."""
