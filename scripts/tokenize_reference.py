"""Hugging Face `tokenizers` reference for `strata bench tokenize`.

  make-tokenizer  trains a byte-level BPE tokenizer on a text file (nothing is downloaded)
                  and saves it as tokenizer.json;
  encode          encodes a text file as Strata's tokenize does: pieces ending at the first
                  line end past --piece-bytes, --batch-pieces at a time through
                  Tokenizer.encode_batch (which spreads them over the cores); writes the ids
                  as raw little-endian u32 to --out and prints the token count and the
                  seconds of reading and encoding (writing excluded).

Run it with the project's virtual environment: .venv/bin/python scripts/tokenize_reference.py
"""

import argparse
import json
import time

import numpy as np


def pieces(path, piece_bytes, batch_pieces):
    batch, piece = [], []
    size = 0
    with open(path, "rb") as f:
        for line in f:
            piece.append(line)
            size += len(line)
            if size >= piece_bytes:
                batch.append(b"".join(piece).decode("utf-8"))
                piece, size = [], 0
                if len(batch) == batch_pieces:
                    yield batch
                    batch = []
    if piece:
        batch.append(b"".join(piece).decode("utf-8"))
    if batch:
        yield batch


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-tokenizer")
    make.add_argument("--text", required=True)
    make.add_argument("--vocab", type=int, required=True)
    make.add_argument("--out", required=True)
    enc = sub.add_parser("encode")
    enc.add_argument("--tokenizer", required=True)
    enc.add_argument("--input", required=True)
    enc.add_argument("--piece-bytes", type=int, required=True)
    enc.add_argument("--batch-pieces", type=int, required=True)
    enc.add_argument("--out", required=True)
    args = ap.parse_args()

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if args.command == "make-tokenizer":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=args.vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      show_progress=False)
        tok.train([args.text], trainer)
        tok.save(args.out)
        print(json.dumps({"vocab": tok.get_vocab_size()}))
        return
    tok = Tokenizer.from_file(args.tokenizer)
    encoded = []
    started = time.perf_counter()
    for batch in pieces(args.input, args.piece_bytes, args.batch_pieces):
        encoded.extend(e.ids for e in tok.encode_batch(batch, add_special_tokens=False))
    seconds = time.perf_counter() - started
    ids = np.fromiter((i for piece in encoded for i in piece), dtype="<u4")
    ids.tofile(args.out)
    print(json.dumps({"tokens": int(ids.size), "seconds": seconds}))


if __name__ == "__main__":
    main()
