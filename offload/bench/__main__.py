"""`python -m offload.bench` == `offload-bench`."""
import sys

from offload.bench.cli import main

# The guard matters: worker processes start from a forkserver, and multiprocessing imports
# the parent's __main__ module into every child (as __mp_main__).
if __name__ == "__main__":
    sys.exit(main())
