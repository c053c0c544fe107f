"""Integrations with model libraries (optional extras).

``hyper_parallel.integrations.transformers``: ``parallelize_model`` for Hugging Face causal LMs
(``pip install 'hyper-parallel[hf]'``). Importing this package imports no model library.
"""
