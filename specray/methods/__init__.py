"""Decoding algorithms: verification rules, residual samplers, decoding loops."""
