"""What every dimension needs to know about a model it did not write: its block stack, its tied weights, and how
it gets memory when built on the meta device."""
