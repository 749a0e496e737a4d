"""The gateway: the front door. Owns text: tokenizer, chat template, validation, incremental
detokenization, stop strings. Imports neither torch nor engine/."""
