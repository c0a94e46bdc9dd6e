"""Tiny models with an MTP draft and data the trunk itself wrote (so a greedy round's fed tokens are its own)."""

from __future__ import annotations

import numpy as np
import torch

from cortiq import store
from cortiq.arch import Arch
from cortiq.cmf import new_doc, specs_from_tensors, write_cmf
from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

V, EOS = 259, 256


def tiny_arch(mtp=True) -> Arch:
    return Arch(arch_name="qwen3", vocab_size=V, hidden_size=32, num_layers=2, intermediate_sizes=[64, 64], num_heads=4,
                num_kv_heads=2, head_dim=8, qk_norm=True, rms_norm_eps=1e-6, tie_word_embeddings=True,
                mtp_layers=int(mtp), mtp_intermediate_size=64 if mtp else 0, max_position_embeddings=256)


def write_model(path, mtp=True, seed=0, chat_template=None):
    from cortiq.model.decoder import CausalLM

    torch.manual_seed(seed)
    arch = tiny_arch(mtp)
    m = CausalLM(arch)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.3 if "embed" in n else 0.15)
    doc = new_doc(arch, tokenizer_doc(byte_tokenizer_json(), [EOS], chat_template=chat_template))
    write_cmf(path, doc, specs_from_tensors(m.state_dict().items(), "f32"))
    return path


@torch.no_grad()
def greedy_records(model_path, n: int, T: int, seed=0) -> np.ndarray:
    """[n, T] sequences the trunk decodes greedily from random first tokens."""
    from cortiq.model import load_model

    m = load_model(model_path)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (n, 1), generator=g)
    for _ in range(T - 1):
        nxt = m(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    return ids.numpy().astype(np.uint32)


def write_tdata(d, rows: np.ndarray):
    from cortiq.data.tdata import ARROW, Record, records_table, tokenizer_digest

    recs = [Record(f"r{i}", "train", "text", r, 1) for i, r in enumerate(rows)]
    meta = {"stage": "tdata", "version": 1, "digest": store.digest("tdata-test", 1, None, [str(rows.sum())]),
            "eos_id": EOS, "vocab_size": V, "tokenizer_digest": tokenizer_digest(byte_tokenizer_json())}
    with store.stage_dir(d, meta) as part:
        store.write_arrow(part / ARROW, records_table(recs))
    return d
