"""Model checkpoints in Hugging Face layout: reading weights into a built model (and building models locally)."""
