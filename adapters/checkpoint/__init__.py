"""Checkpoint I/O: a Hugging Face source opened in one call (:mod:`.hf_source`), Hugging Face checkpoint files
(:mod:`.hf_checkpoint`), safetensors (:mod:`.safetensors_io`), the Hub (:mod:`.hf_hub`), Orbax state dicts
(:mod:`.orbax_store`) and publishing a directory by renames (:mod:`.directory_swap`)."""
