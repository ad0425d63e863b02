"""Train DeepFM with its embeddings on parameter-server shards.

    python examples/train_deepfm.py
    python examples/train_deepfm.py --data ../shared/data/avazu_train_head10k.csv --schema avazu

Every flag of ``python -m worker.trainer --help`` works here; with no ``--addresses``
it starts its own shards on 127.0.0.1 (``deploy.train``).
"""

from __future__ import annotations

import sys

from deploy.train import main

if __name__ == "__main__":
    main(["--model=deepfm", *sys.argv[1:]])
