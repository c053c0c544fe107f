"""Op dispatch on DTensors: a user-level call -> its sharding rule -> redistribution -> the local op under
the framework's autograd -> wrapped outputs (dispatcher.py); the cache-hit fast path (fast_path.py,
fast_autograd.py) and the per-signature decision cache (decision_cache.py); the one extension point
(interceptors.py); ops without a rule (fallback.py); nested arguments (tree.py).

Nothing is imported here, so importing one module of this package never pulls in the others;
DTensor's entry points (dtensor.py) import the ones they delegate to on first use."""
