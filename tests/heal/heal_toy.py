"""A toy decoder with the model API the trainer uses (embed, run_layers, layers,
model.norm, head_weight, named parameters model.layers.{i}.{mixer,mlp}.*)."""

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from cortiq.heal.rows import WindowRows
from cortiq.heal.kinds import mix_targets
from cortiq.data.windowing import batch_indices
from cortiq.heal.train import SplitData, train_index
from cortiq.model.decoder import run_body


class Mlp(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.up_proj = nn.Linear(h, 2 * h, bias=False)
        self.down_proj = nn.Linear(2 * h, h, bias=False)

    def forward(self, x):
        return self.down_proj(torch.tanh(self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.mix = nn.Linear(h, h, bias=False)
        self.mlp = Mlp(h)

    #: heal's memory "checkpoint" and the compiled body, run as the real decoder layer runs them
    recompute = False
    compiled = None

    def forward(self, x):
        return run_body(self, x)

    def _forward(self, x):
        # a causal running mean stands in for attention
        c = x.cumsum(1) / torch.arange(1, x.shape[1] + 1, dtype=x.dtype, device=x.device)[None, :, None]
        x = x + torch.tanh(self.mix(c))
        return x + self.mlp(x)


class ToyLM(nn.Module):
    def __init__(self, vocab=37, hidden=16, layers=3, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(vocab, hidden)
        self.model.layers = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.model.norm = nn.LayerNorm(hidden, elementwise_affine=False)

    @property
    def layers(self):
        return self.model.layers

    @property
    def head_weight(self):
        return self.model.embed_tokens.weight

    def embed(self, ids):
        return self.model.embed_tokens(ids)

    def run_layers(self, h, a, b):
        for i in range(a, b):
            h = self.layers[i](h)
        return h

    def forward_hidden(self, ids):
        return self.model.norm(self.run_layers(self.embed(ids), 0, len(self.layers))), {}


def _rows(arr):
    n = arr.shape[0]
    flat = np.ascontiguousarray(arr).reshape(-1)
    t = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(flat), flat.size // n)})
    return WindowRows(t, "x", arr.shape[1:])


def toy_split(teacher, n, T, batch, k, ce=0.0, seed=0, train=True, prefix_of=None):
    g = torch.Generator().manual_seed(seed)
    V = teacher.head_weight.shape[0]
    ids = torch.randint(0, V, (n, T + 1), generator=g)
    weight = (torch.rand(n, T, generator=g) > 0.2).float()
    with torch.no_grad():
        h, _ = teacher.forward_hidden(ids[:, :-1])
        probs = torch.softmax(h @ teacher.head_weight.t(), -1)
        tp, tid = probs.topk(k, -1)
        tp = tp / tp.sum(-1, keepdim=True)
    mi, mp = mix_targets(tid.reshape(-1, k), tp.reshape(-1, k), ids[:, 1:].reshape(-1), weight.reshape(-1), ce)
    kk = mi.shape[1]
    index = train_index(n, batch) if train else batch_indices(n, batch)
    h0 = None
    if prefix_of is not None:
        tail, = prefix_of
        h0 = _rows(tail.start(ids[:, :-1]).numpy().astype(np.float32))
    return SplitData(ids[:, :-1].numpy(), _rows(mi.reshape(n, T, kk).numpy().astype(np.uint32)),
                     _rows(mp.reshape(n, T, kk).numpy().astype(np.float32)), weight.sum(1).double().numpy(), index, h0)


class Killed(Exception):
    """What `KillAt` raises: a run killed mid-training (resume tests)."""


class KillAt:
    """A logger that kills the run when the training loss of step `step` is logged."""

    def __init__(self, step):
        self.step = step

    def log_metrics(self, metrics, step=None):
        if step == self.step and "loss" in metrics:
            raise Killed()

    def log_params(self, p):
        pass

    def log_artifact(self, *a, **k):
        pass

    def set_tags(self, tags):
        pass
