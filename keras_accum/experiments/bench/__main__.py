"""`python -m keras_accum.experiments.bench PAYLOAD`: one worker task (the
benchmark's own subprocesses; the command line is `scripts/bench.py`)."""

import sys

from keras_accum.experiments.bench.worker import main

if __name__ == "__main__":
    main(sys.argv[1])
