"""`murmur sim`: K workers of a sync algorithm in one process, every byte counted.

Modules: runner (the command, the threaded engine, results and plots), stacked (the engine that
stacks K replicas along a leading dimension and trains them as one).
"""
