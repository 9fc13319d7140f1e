"""A corpus that needs no download: the Python documentation topics that the standard
library ships (`pydoc_data.topics`), as bytes. Byte-level: vocab 256."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def pydoc_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def text_bytes(text: str) -> torch.Tensor:
    """`text`'s UTF-8 bytes as int64 ids (vocab 256)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).to(torch.long)


def text_ids(tokenizer: Any, text: str, *, piece_chars: int = 1 << 20, batch: int = 4) -> torch.Tensor:
    """`text`'s ids by a transformers `tokenizer` (no special tokens added) as int64,
    tokenized `batch` pieces of about `piece_chars` characters at a time, each cut after a
    line end (else a space; a text of one piece is tokenized whole): the tokenizer's own
    output of a whole text (its Python lists, offsets and token strings) takes about 200
    bytes of memory per byte of text, and a Ctrl-C waits for it. Tokens across a cut may
    differ from those of the text tokenized whole."""
    pieces, at = [], 0
    while at < len(text):
        end = len(text)
        for sep in ("\n", " "):
            cut = text.find(sep, at + piece_chars)
            if cut >= 0:
                end = cut + 1
                break
        pieces.append(text[at:end])
        at = end
    out = [torch.zeros(0, dtype=torch.long)]
    for i in range(0, len(pieces), batch):
        ids = tokenizer(pieces[i : i + batch], add_special_tokens=False, return_attention_mask=False,
                        verbose=False)["input_ids"]
        out.extend(torch.tensor(x, dtype=torch.long) for x in ids)
    return torch.cat(out)


def pydoc_bytes() -> torch.Tensor:
    return text_bytes(pydoc_text())


def random_windows(
    corpus: torch.Tensor, *, batch: int, seq: int, seed: int = 0, holdout: float = 0.05
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets) batches of random windows from the training part."""
    n_train = int(len(corpus) * (1 - holdout))
    data = corpus[:n_train]
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        x = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
        yield x[:, :-1].contiguous(), x[:, 1:].contiguous()


def holdout_windows(
    corpus: torch.Tensor, *, batch: int, seq: int, batches: int, holdout: float = 0.05
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`batches` (inputs, targets) batches of windows spread evenly over the held-out tail
    that `random_windows` never draws from (the same every time: no generator)."""
    n_train = int(len(corpus) * (1 - holdout))
    last = len(corpus) - seq - 1  # the last start a whole window fits after
    if last < n_train:
        raise ValueError(f"the held-out text ({len(corpus) - n_train} bytes) is shorter than one window ({seq + 1})")
    starts = torch.linspace(n_train, last, batch * batches).round().long().tolist()
    x = torch.stack([corpus[s : s + seq + 1] for s in starts]).view(batches, batch, seq + 1)
    return [(b[:, :-1].contiguous(), b[:, 1:].contiguous()) for b in x]
