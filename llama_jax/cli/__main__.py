"""`python -m llama_jax.cli`: the `llama-jax` command."""

import sys

from llama_jax.cli import main

sys.exit(main())
