"""Wan2.x components both model families use (DreamZero, LingBot-VA): the VAE, UMT5, flow schedules, RoPE, tiny and
synthetic weights, the memory-plan arithmetic. Each family keeps its own transformer and episode logic."""
