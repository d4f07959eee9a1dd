"""torchlike's training scripts, TRL's ``trl/scripts/<name>.py`` on torchlike (sft, grpo, rloo, dpo, kto, reward,
distillation) and its ``examples/scripts/<name>.py`` for the ``trl.experimental`` trainers (online_dpo, orpo, cpo,
gkd, xpo, nash_md, bco): ``torchlike <name>``.

Each module has ``make_parser(prog)`` and ``main(script_args, training_args, model_args, dataset_args)`` and runs as
``python -m torchlike.trl.scripts.<name>``; what they share lives in :mod:`torchlike.trl.scripts.common`.
"""
