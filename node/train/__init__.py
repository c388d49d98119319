"""Training on one machine.

Modules: trainer (`murmur train`: the single-node trainer with checkpoints and exact resume, and
the helpers every engine shares to build a model from a run config).
"""
