"""Communication / compute overlap: the head-chunk pipeline of ``overlap=True`` (pipeline.py) and
``start_attention``, one call split into start and finish (split_call.py)."""
