"""torchlike.trl.experimental: TRL 1.16's ``trl.experimental`` trainers, under the same module paths
(``from trl.experimental.orpo import ORPOTrainer`` -> ``from torchlike.trl.experimental.orpo import ORPOTrainer``)."""
