"""Formats of other projects: Hugging Face Llama weights (config.json + safetensors, streamed a block at a time)
and Hugging Face PEFT adapter directories.

    hf_config.py          Hugging Face config.json <-> our ModelConfig
    hf_tensor_map.py      which Hugging Face tensor each of our parameters is, and in which layout
    hf.py                 Hugging Face safetensors <-> our (sharded) params, streamed a block at a time
    safetensors_files.py  safetensors files, sharded as Hugging Face writes them: a slice reader, a streaming
                          writer
    peft_format.py        adapters as adapter_config.json + adapter_model.safetensors

Imports config/, model/ and errors.py; reading a model spec or converting a run is checkpoint/'s.
"""
