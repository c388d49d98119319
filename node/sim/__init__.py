"""`murmur sim`: K workers of a sync algorithm in one process, every byte counted.

Modules: cli (the command), run (`run_sim`: drives the chosen engine, replica 0 reporting),
replicas (what both engines build replicas from: warm starts, the in-process group, each
replica's data), stacked (the engine that stacks K replicas along a leading dimension and trains
them as one), threaded (a module and a thread per replica), report (progress lines, the result,
its table and plot), errors (SimError, which the command line raises without importing torch).
"""
