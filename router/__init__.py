"""llama-router: one endpoint for many local GGUF models."""
