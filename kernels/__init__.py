"""Triton kernels of the engine, each with a torch reference, an admission predicate and a contract.

The registry is kernels/KERNELS.md once kernels land; nothing here imports the rest of the project.
"""
