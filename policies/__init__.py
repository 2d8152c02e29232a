"""Policies the session engine drives: the policy interface, the registry, and DreamZero."""
