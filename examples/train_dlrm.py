"""Train DLRM with its embeddings on parameter-server shards.

    python examples/train_dlrm.py                       # generated Criteo-like data, 2 local shards
    python examples/train_dlrm.py --data ../shared/data/criteo_kaggle_train_head10k.txt
    ps-launch --shards 2 --workers 2 -- python examples/train_dlrm.py

Every flag of ``python -m worker.trainer --help`` works here; with no ``--addresses``
it starts its own shards on 127.0.0.1 (``deploy.train``).
"""

from __future__ import annotations

import sys

from deploy.train import main

if __name__ == "__main__":
    main(["--model=dlrm", *sys.argv[1:]])
