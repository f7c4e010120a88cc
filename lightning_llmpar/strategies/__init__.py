"""The Lightning adapters: the strategy class over the plain functions, and the registered strategy names."""
