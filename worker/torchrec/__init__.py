"""TorchRec models on the parameter server: drop-in embedding modules, FBGEMM's optimizer names.

``PSEmbeddingBagCollection`` stands where TorchRec's ``EmbeddingBagCollection`` stands (a DLRM,
a DeepFM), ``PSEmbeddingCollection`` where its ``EmbeddingCollection`` does; ``fused_params``
speak FBGEMM's vocabulary (``worker.torchrec.configs``). Needs TorchRec (the ``torchrec`` extra;
the README's set-up line installs it with FBGEMM's CPU build); the rest of ``worker`` does not.
"""

from __future__ import annotations

import logging

try:
    # TorchRec's import logs a warning through torch.fx that says nothing about the user's code.
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    import torchrec  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "worker.torchrec needs TorchRec: pip install -c constraints.txt -e '.[torchrec]' ./deploy/fbgemm-gpu-cpu "
        f"(on CPU; see docs/guides/torchrec.md) ({exc})"
    ) from exc

from worker.torchrec.configs import optimizer_of, shard_tables
from worker.torchrec.modules import PSEmbeddingBagCollection, PSEmbeddingCollection

__all__ = ["PSEmbeddingBagCollection", "PSEmbeddingCollection", "optimizer_of", "shard_tables"]
