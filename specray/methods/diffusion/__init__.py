"""diffusion family decoding methods: params.py (typed parameters), rules.py (verification), loop.py."""
