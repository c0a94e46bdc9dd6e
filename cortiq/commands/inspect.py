"""`cortiq inspect FILE.cmf [--json]`: architecture, tensors per codec, bytes, provenance."""

from __future__ import annotations

HELP = "show a CMF file's architecture, tensors per codec, bytes and provenance"
ORDER = 20


def add_arguments(p):
    p.add_argument("file", metavar="FILE.cmf", help="the CMF file (the first file of a sharded model)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text")


def summary(f) -> dict:
    """What `inspect` reports about an open CmfFile."""
    import math

    per: dict[str, dict] = {}
    for i in f.infos.values():
        c = per.setdefault(i.codec, {"tensors": 0, "params": 0, "bytes": 0})
        c["tensors"] += 1
        c["params"] += math.prod(i.shape)
        c["bytes"] += i.nbytes
    tok = f.tokenizer or {}
    return {
        "path": str(f.path),
        "files": [str(p) for p in f.paths],
        "format_version": f.doc.get("version"),
        "arch": f.arch.to_dict(),
        "tensors": len(f.infos),
        "params": sum(c["params"] for c in per.values()),
        "bytes": f.nbytes(),
        "codecs": dict(sorted(per.items())),
        "tokenizer": None if not tok.get("json") else {
            "eos_ids": tok.get("eos_ids"), "bos_id": tok.get("bos_id"),
            "special_ids": len(tok.get("special_ids") or []), "chat_template": bool(tok.get("chat_template")),
        },
        # what the draft's token ranking (cortiq.mtp.vocab) was counted on, where the file has one
        "draft_vocab": (f.doc.get("draft_vocab") or {}).get("counted"),
        "provenance": f.provenance,
    }


def run(args) -> int:
    import json

    from ..cmf import open_cmf

    s = summary(open_cmf(args.file))
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    a = s["arch"]
    widths = sorted(set(a["intermediate_sizes"]))
    print(f"{s['path']}  ({len(s['files'])} file(s), format v{s['format_version']})")
    print(f"arch       {a['arch_name']}: {a['num_layers']} layers, hidden {a['hidden_size']}, "
          f"MLP {widths[0] if len(widths) == 1 else f'{widths[0]}..{widths[-1]}'}, "
          f"{a['num_heads']} heads / {a['num_kv_heads']} KV heads × {a['head_dim']}, vocab {a['vocab_size']}, "
          f"{'tied' if a['tie_word_embeddings'] else 'untied'} embeddings, rope θ {a['rope_theta']:g}, "
          f"rms eps {a['rms_norm_eps']:g}" + (f", MTP layers {a['mtp_layers']}" if a["mtp_layers"] else ""))
    print(f"tensors    {s['tensors']}, {s['params']:,} parameters, {s['bytes']:,} bytes")
    for name, c in s["codecs"].items():
        print(f"  {name:<8} {c['tensors']:>5} tensors {c['params']:>14,} params {c['bytes']:>14,} bytes")
    t = s["tokenizer"]
    print("tokenizer  " + ("none" if t is None else
                           f"eos {t['eos_ids']}, bos {t['bos_id']}, {t['special_ids']} special tokens, "
                           f"chat template {'yes' if t['chat_template'] else 'no'}"))
    if s["draft_vocab"]:
        print(f"draft      tokens ranked by {s['draft_vocab']} (--draft-vocab N)")
    print("provenance" + ("  none" if not s["provenance"] else ""))
    for stage, block in s["provenance"].items():
        print(f"  {stage}: {json.dumps(block)}")
    return 0
