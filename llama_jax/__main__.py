"""`python -m llama_jax ...` is the same as `llama-jax ...`."""

import sys

from llama_jax.cli import main

sys.exit(main())
