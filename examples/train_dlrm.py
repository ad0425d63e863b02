"""Train DLRM with its embeddings on parameter-server shards.

    python examples/train_dlrm.py                       # generated Criteo-like data, 2 local shards
    python examples/train_dlrm.py --data ../shared/data/criteo_kaggle_train_head10k.txt
    python examples/train_dlrm.py --data ../shared/data/movielens_ml-100k_u.data --schema movielens
    ps-launch --shards 2 --workers 2 -- python examples/train_dlrm.py

A click log trains on its first 80% of rows and reports AUC on the rest; batch size and
epochs are chosen from the training rows (the config line at start says what was used).
Output goes to runs/<UTC time>/ (runs/latest points at the newest). Every flag of
``python -m deploy.train --help`` works here; with no ``--addresses`` it starts its own
shards on 127.0.0.1.
"""

from __future__ import annotations

import sys

from deploy.train import main

if __name__ == "__main__":
    main(["--model=dlrm", *sys.argv[1:]])
