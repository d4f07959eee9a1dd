"""Qwix LoRA on Tunix modules, one module per job; import the one you need.

- :mod:`.runtime`: applying LoRA, the per-trace modes (dropout only in training, the adapter switched off, merged
  weights), the one-matmul ``lora_linear`` and the factors a module holds.
- :mod:`.targets`: which modules ``target_modules`` names, PEFT's default targets.
- :mod:`.peft_format`: the factors to and from PEFT's ``lora_A (r, in)`` / ``lora_B (out, r)`` layout.
- :mod:`.merge`: ``W + scale * B @ A`` for every adapted weight.
"""
