"""Data: text in, batches out, host side only.

    corpus.py     inputs (text, jsonl, parquet, hf:DIR, the bundled plays) -> units of work -> documents
    tokenizer.py  Hugging Face, Llama 3 tiktoken and sentencepiece tokenizers, and a BPE trained here
    prepare.py    `llama-jax prepare`: documents -> a token store on disk
    loader.py     packing plans and Grain batches, a pure function of (seed, step, settings)
    streams.py    the trainer's view: config -> token stores -> train and validation batch streams

Imports config/, files.py and errors.py.
"""
