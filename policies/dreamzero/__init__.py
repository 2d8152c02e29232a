"""DreamZero world action model (Wan2.1-I2V causal DiT with an action register)."""
