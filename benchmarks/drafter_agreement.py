"""How often the ``eagle`` drafter's network agrees with the target, teacher-forced, per
draft level: on held-out book text and on held-out text the target wrote itself.

    python benchmarks/drafter_agreement.py --self-text DIR [--weights shipped,DIR,...]
        [--windows 64] [--depth 4] [--out DIR]

Book text: ``../shared/data/pg_books.jsonl``'s held-out book (``wuthering_heights``,
never trained on). Self-generated text: a ``tokenswift distill`` directory whose shards
no drafter was trained on (e.g. ``tokenswift distill --seed 7 --shards 2 --out DIR``:
one greedy shard, one sampled), or a ``--self-text`` directory with ``:last`` appended
for its last 5% (what ``train-drafter`` holds out of it). Per level k, the share of
positions where the draft's top-1 is the target's top-1 (``top1``: raw logits;
``greedy_top1``: both after the presets' penalty, the token greedy decoding emits) and
where its top-3 holds it, with level k fed the draft's own level k-1 (as it drafts).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tokenswift.drafters.feature_net import FeatureNet, find_shipped_drafter
from tokenswift.machine import machine_name
from tokenswift.model.loading import load_model
from tokenswift.spec import ModelSpec
from tokenswift.tools.drafter_training import DrafterTrainConfig, evaluate
from tokenswift.tools.self_distill import read_shards
from tokenswift.tools.training import read_corpus

BOOKS = Path(__file__).resolve().parents[2] / "shared" / "data" / "pg_books.jsonl"


def texts(tokenizer, self_text: str | None) -> dict[str, torch.Tensor]:
    out = {"book (wuthering_heights)": read_corpus(BOOKS, tokenizer, ("wuthering_heights",)).held_out}
    if self_text:
        path, _, part = self_text.partition(":")
        corpus = read_corpus(path, tokenizer, ())
        tokens = corpus.held_out if part == "last" else torch.cat([corpus.train, corpus.held_out])
        out[f"self-generated ({self_text})"] = tokens
        if not part:  # the target's greedy text and its sampled text apart
            for decoding in ("greedy", "sampled"):
                records = [r for r in read_shards(path) if r.get("decoding") == decoding]
                if records:
                    ids = [tokenizer(r["text"], add_special_tokens=False)["input_ids"] for r in records]
                    out[f"self-generated, {decoding} ({self_text})"] = torch.tensor([t for row in ids for t in row])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="shipped", help="comma-separated: 'shipped' or train-drafter directories")
    parser.add_argument("--self-text", help="a tokenswift distill directory (DIR:last for its last 5%%)")
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="benchmarks/results/drafter-agreement")
    args = parser.parse_args()
    model, tokenizer = load_model(ModelSpec(path="smollm2", dtype=args.dtype))
    config = DrafterTrainConfig(eval_windows=args.windows, eval_depth=args.depth, seq_len=args.seq_len)
    rows = []
    corpora = texts(tokenizer, args.self_text)
    for weights in args.weights.split(","):
        source = find_shipped_drafter(model) if weights == "shipped" else Path(weights)
        net = FeatureNet.from_pretrained(source, model).float().eval()
        for text, tokens in corpora.items():
            metrics = evaluate(net, model, tokens, config)
            rows.append({"weights": weights, "text": text, "tokens": int(len(tokens)), **metrics})
            print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = {"machine": machine_name(torch.device("cpu")), "dtype": args.dtype, "windows": args.windows,
            "seq_len": args.seq_len, "depth": args.depth}
    (out / "agreement.json").write_text(json.dumps({"info": info, "rows": rows}, indent=2) + "\n")
    lines = ["| weights | text | greedy top-1 per level | top-1 (raw) per level | top-3 (raw) per level |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['weights']} | {r['text']} | {' / '.join(f'{v:.3f}' for v in r['greedy_top1'])} | "
              f"{' / '.join(f'{v:.3f}' for v in r['top1'])} | {' / '.join(f'{v:.3f}' for v in r['top3'])} |" for r in rows]
    (out / "agreement.md").write_text("\n".join(lines) + f"\n\n{info['machine']}, {args.dtype}, {args.windows} windows "
                                      f"of {args.seq_len} tokens, seed 1\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
