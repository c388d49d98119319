"""Training on one machine, and the pieces every engine shares.

Modules: step (THE inner step every engine runs, autocast and evaluation), build (the device, the
run's dataset and the model from a run config), trainer (`murmur train`: the single-node trainer
with checkpoints and exact resume), train_cli (its command line, declared without torch), overrides
(the one rule for `--config`, shortcut flags and `--set` on every command line), gpu_path (the
`--kernels` and `--compile` flags).
"""
