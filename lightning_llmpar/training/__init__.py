"""Pieces of one training step shared by every layout: batches, loss normalization, global-norm clipping."""
