"""Host-side engine core (plain Python, no jax)."""
