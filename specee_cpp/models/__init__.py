"""Model files: the registry (models.toml), fetching (pull) and GGUF inspection."""
