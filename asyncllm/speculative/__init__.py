"""Speculative decoding's proposers of draft tokens (proposer.py: the interface; ngram.py: prompt
lookup). The setting is Config.speculative_config (config.py); the engine drafts and learns in
engine/speculation.py; docs/ARCHITECTURE.md "Speculative decoding" tells the whole path."""
