"""Running a trained model: generation with a preallocated key/value cache, on one device or sharded over the
mesh the params are on.

    generate.py  prefill + one jitted decode step per token; sampling; the cache-free reference

Imports distributed/, model/, config/ and errors.py.
"""
