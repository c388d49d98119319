"""The model and its data, free of any networking.

Modules: transformer (the Llama-style model and its presets), stages (its cut into pipeline
stages), tokenizer (byte-level and GPT-2 BPE), corpus (the bundled text and text folders), data
(token shards, the manifest, batch loaders), data_cli (`murmur data`).
"""
