"""Formats of other projects: Hugging Face Llama weights (config.json + safetensors, streamed a block at a time)
and Hugging Face PEFT adapter directories.

    hf.py                 Hugging Face config and safetensors <-> our (sharded) params
    safetensors_files.py  safetensors files, sharded as Hugging Face writes them: a slice reader, a streaming
                          writer
    peft_format.py        adapters as adapter_config.json + adapter_model.safetensors

Imports config/, model/ and errors.py; reading a model spec or converting a run is checkpoint/'s.
"""
