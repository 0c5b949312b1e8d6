"""The model: the local default, loading it, and prompts to token ids."""
