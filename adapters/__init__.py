"""Backend adapters: the only code that talks to Tunix, Qwix, Orbax, safetensors and HF weight names.

Installed as ``torchlike.adapters`` (the folder sits at the repository's top level;
PyPI already has an unrelated package named ``adapters``). Nothing here imports the
``torchlike`` facade.
"""
