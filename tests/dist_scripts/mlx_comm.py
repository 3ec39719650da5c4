"""MlxComm and the summed gradient, run by tests/test_dist_mlx.py: under
``mlx.launch -n 2 --backend ring python tests/dist_scripts/mlx_comm.py OUT MODEL_DIR`` each
rank writes OUT/rank{r}.json; run plainly (one process) it writes OUT/rank0.json for the
same optimizer step on the whole batch, the reference the two ranks' sum must equal.

    python tests/dist_scripts/mlx_comm.py OUT MODEL_DIR
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten
from omegaconf import OmegaConf

from finetune.backends.base import Batch
from finetune.backends.mlx.runtime import MlxBackend
from finetune.config import Config
from finetune.data.batches import rank_slice
from finetune.resolver import resolve
from finetune.synthetic import generate


def make_batch(model_dir: Path, n: int = 4) -> Batch:
    """``n`` built-in samples, tokenized by the tiny tokenizer, prompt masked, right-padded and
    sorted longest first (as the loop's step batches are), at most 40 tokens each."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rows, masks = [], []
    for r in generate(n, seed=0):
        p, c = tok.encode(r["prompt"]).ids, tok.encode(r["completion"]).ids + [0]
        rows.append((p + c)[-40:])
        masks.append(([0] * len(p) + [1] * len(c))[-40:])
    order = sorted(range(n), key=lambda i: -len(rows[i]))
    t = max(map(len, rows))
    ids, mask = np.zeros((n, t), np.int32), np.zeros((n, t), np.int8)
    for i, j in enumerate(order):
        ids[i, : len(rows[j])], mask[i, : len(masks[j])] = rows[j], masks[j]
    return Batch(ids, mask, np.array([len(rows[j]) for j in order], np.int32), np.array(order, np.int64))


def digest(tree: object) -> str:
    h = hashlib.sha256()
    for k, v in tree_flatten(tree):
        h.update(k.encode() + np.array(v).tobytes())
    return h.hexdigest()


def main(out: Path, model_dir: Path) -> None:
    b = MlxBackend()
    comm = b.connect(None)
    r, w = comm.rank, comm.world_size
    res: dict = {"rank": r, "world_size": w, "local_rank": comm.local_rank, "description": comm.description}
    res["sum"] = comm.all_reduce([1.0 + r * 2.0**-40, 10.0 * (r + 1), -1.0], "sum")
    res["max"] = comm.all_reduce([float(r), -float(r), 3.5], "max")
    res["empty"] = comm.all_reduce([])
    res["gathered"] = comm.all_gather_object({"rank": r, "blob": "x" * (1000 * r + 1), "t": (r, None)})
    comm.barrier()

    cfg = OmegaConf.structured(Config(run_dir="unused"))
    cfg.backend.name = "mlx"
    cfg.method.lora.num_layers = 1  # a trainable tree that skips a block
    cfg.optim.max_grad_norm = 0.1  # below the norm (~0.24): the clip acts on the summed gradient
    cfg.train.seed = 1000 + r  # ranks other than 0 draw other LoRA inits: setup must broadcast rank 0's
    b.setup(resolve(cfg), model_dir)
    res["init_digest"] = digest(b.model.trainable_parameters())

    batch = make_batch(model_dir)
    scale = 1.0 / batch.label_tokens  # the whole step's tokens, on every rank
    res["loss_sum"] = comm.all_reduce([b.forward_backward(rank_slice(batch, r, w), scale)])[0]
    res["grad_norm"] = b.optimizer_step(1e-2)
    res["step_digest"] = digest(b.model.trainable_parameters())
    res["weights"] = {k: np.array(v).ravel()[:64].tolist() for k, v in tree_flatten(b.model.trainable_parameters())}
    b.save_adapter(out / "adapter" if r == 0 else None)
    b.save_state(out / "state" if r == 0 else None)
    comm.barrier()
    (out / f"rank{r}.json").write_text(json.dumps(res))
    comm.close()


if __name__ == "__main__":
    out_dir = Path(sys.argv[1])
    for d in ("adapter", "state"):
        (out_dir / d).mkdir(parents=True, exist_ok=True)
    main(out_dir, Path(sys.argv[2]))
