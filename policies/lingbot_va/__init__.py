"""LingBot-VA world action model (Wan2.2 shared-backbone video/action transformer)."""
