# Source this on a machine where murmur is not pip-installed (the GPU box: torch and triton are
# there, no internet, no hivemind): it lays the source tree out as the installed package would
# (pyproject's package-dir) under a temp folder and puts that on PYTHONPATH.
#   source benchmarks/gpu_env.sh && python3 benchmarks/kernels.py
_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_site="$(mktemp -d)"
mkdir -p "$_site/murmur"
for f in "$_repo"/murmur/*; do ln -s "$f" "$_site/murmur/"; done
for sub in node protocol optim kernels coordinator; do ln -s "$_repo/$sub" "$_site/murmur/$sub"; done
export PYTHONPATH="$_site${PYTHONPATH:+:$PYTHONPATH}"
unset _repo _site f sub
