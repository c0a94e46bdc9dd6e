"""The multi-token-prediction (MTP) draft block, `model.mtp.*`.

Row p of the block reads the trunk's final hidden row h_p (after model.norm)
and the embedding of token p+1, and predicts token p+2:

    x   = eh_proj · [enorm(embed(tok_{p+1})); hnorm(h_p)]     # [B, T, 2H] -> [B, T, H]
    x   = layers.0(x)                                         # one full-attention decoder layer
    out = norm(x)                                             # logits = the shared head on out

`out` has the same role as a trunk final hidden row, so drafts chain: step
j+1 reads step j's `out` in place of h. Positions are the row indices p, as
the trunk's (the block runs over the same rows).
"""

from __future__ import annotations

import torch
from torch import nn

from ..arch import FULL, Arch


class MTPBlock(nn.Module):
    def __init__(self, arch: Arch):
        super().__init__()
        from .decoder import DecoderLayer, RMSNorm

        H, off = arch.hidden_size, arch.norm_style == "offset"
        width = arch.mtp_intermediate_size or arch.intermediate_sizes[-1]
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.enorm = RMSNorm(H, arch.rms_norm_eps, off)
        self.hnorm = RMSNorm(H, arch.rms_norm_eps, off)
        self.layers = nn.ModuleList([DecoderLayer(arch, FULL, width)])
        self.norm = RMSNorm(H, arch.rms_norm_eps, off)

    def forward(self, h_prev, next_emb, cos, sin, state=None):
        """h_prev [B, T, H] trunk final hidden rows, next_emb [B, T, H] embeddings
        of the tokens after them; cos/sin [T, rotary_dim] for the rows' positions.
        -> normed draft hidden [B, T, H]."""
        x = self.eh_proj(torch.cat([self.enorm(next_emb), self.hnorm(h_prev)], -1))
        x = self.layers[0](x, cos, sin, state)
        return self.norm(x)
