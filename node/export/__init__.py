"""A run's model, out of murmur: `murmur export` (a folder `transformers` loads as LlamaForCausalLM),
`murmur eval` (validation loss of a checkpoint or an export) and `murmur generate` (sampling).

source.py reads what a run left (a checkpoint file, a run or testnet folder, an export) into one
`Source`; llama_format.py maps murmur's parameter names and shape to Llama's; hf_tokenizer.py writes
the run's tokenizer as a tokenizer.json; write.py assembles the folder. The CLI modules
(*_cli.py) stay light: torch comes in once the arguments hold up (tests/test_startup.py).
"""
