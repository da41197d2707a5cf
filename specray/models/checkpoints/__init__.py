"""The official release formats of real models (LlamaGen, MAR, diffusers DDPM / DiT).

``options`` (torch-free) validates a job's ``{format: ...}`` reference; ``reading`` reads files
safely and matches keys strictly; one module per release family builds the official architecture
and maps the release's key layout onto it.
"""
