"""Batches as Hugging Face's collators give them: mappings of input_ids, labels and
attention_mask (DataCollatorForLanguageModeling(mlm=False): labels = input_ids, -100 at
the padding, unshifted). Snake trains on them as the model's own loss does (labels shifted
one to the left, the mean over the global batch's labels that are not -100), the same as
on the pairs they stand for; padding on the left, keys snake would not give the model and
labels on the padding are refused by name."""

from __future__ import annotations

import asyncio

import pytest
import torch

from snake import DataError, SnakeTrainer
from snake.data import IGNORE_INDEX, pair_of
from tests.test_hf import VOCAB, make, snake_config


def hf_batches(n: int, rows: int = 4, seq: int = 16, seed: int = 5, vocab: int = VOCAB) -> list[dict[str, torch.Tensor]]:
    """`n` global batches of right-padded rows of random lengths, as a collator makes them:
    input_ids (padding id 0), attention_mask, labels (input_ids, -100 at the padding)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(2, vocab, (rows, seq), generator=g)
        lengths = torch.randint(seq // 2, seq + 1, (rows,), generator=g)
        mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, 0)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)})
    return out


def test_a_batch_mapping_is_the_pair_its_causal_lm_loss_trains_on():
    batch = hf_batches(1)[0]
    inputs, targets = pair_of(batch)
    assert inputs is batch["input_ids"]
    assert torch.equal(targets[:, :-1], batch["labels"][:, 1:]) and (targets[:, -1] == IGNORE_INDEX).all()
    # without labels: the input_ids, the padding -100 where a mask says which it is
    no_labels = {k: v for k, v in batch.items() if k != "labels"}
    assert torch.equal(pair_of(no_labels)[1], targets)
    assert torch.equal(pair_of({"input_ids": batch["input_ids"]})[1][:, :-1], batch["input_ids"][:, 1:])


@pytest.mark.asyncio
async def test_collated_batches_train_as_the_pairs_they_stand_for_and_with_the_models_own_loss(tmp_path):
    """Trained on the mappings, the weights are bit for bit those of training on their pairs;
    the first step's loss (before any update) and evaluate()'s are the model's own
    `model(**batch).loss` over the whole global batch (with its attention mask)."""
    data = hf_batches(3)
    model = make("llama")
    with torch.no_grad():
        want_loss = model(**data[0]).loss.item()
        want_eval = [model(**b).loss.item() for b in data[1:]]

    async def train(given, directory):
        async with SnakeTrainer(make("llama"), data=given, config=snake_config(directory)) as t:
            before = await t.evaluate(data[1:])
            report = await asyncio.wait_for(t.run(3), timeout=120)
            return await t.state_dict(), report, before

    got, report, before = await train(data, tmp_path / "a")
    pairs, _, _ = await train([pair_of(b) for b in data], tmp_path / "b")
    assert got.keys() == pairs.keys()
    for k, v in pairs.items():
        assert torch.equal(got[k], v), k
    assert report.steps[0].loss == pytest.approx(want_loss, abs=1e-5)
    weights = [int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in data[1:]]
    assert before.loss == pytest.approx(sum(w * x for w, x in zip(weights, want_eval, strict=True)) / sum(weights),
                                        abs=1e-5)


@pytest.mark.parametrize("batch,says", [
    ({"input_ids": torch.ones(2, 4, dtype=torch.long),
      "attention_mask": torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])}, "padding_side = 'right'"),
    ({"input_ids": torch.ones(2, 4, dtype=torch.long), "token_type_ids": torch.zeros(2, 4, dtype=torch.long)},
     "return_token_type_ids=False"),
    ({"input_ids": torch.ones(2, 4, dtype=torch.long), "position_ids": torch.zeros(2, 4, dtype=torch.long)},
     "leave 'position_ids' out"),
    ({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.tensor([[1, 1, 0, 0]] * 2),
      "labels": torch.ones(2, 4, dtype=torch.long)}, "set them to -100"),
    ({"labels": torch.ones(2, 4, dtype=torch.long)}, "needs 'input_ids'"),
    ({"input_ids": [[1, 2]]}, "batch['input_ids'] must be a torch.Tensor"),
    ({"input_ids": torch.ones(4, dtype=torch.long)}, "shape (batch, seq)"),
    ({"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.ones(2, 3, dtype=torch.long)},
     "batch['labels'] has shape (2, 3)"),
    ({"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.ones(2, 4, dtype=torch.int32)}, ".long()"),
    ({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.full((2, 4), 2)}, "must hold 0"),
    ({"input_ids": torch.ones(2, 4, dtype=torch.long), "attention_mask": torch.ones(2, 4)}, "must hold 0"),
    ({"input_ids": torch.ones(2, 4)}, "batch['input_ids'] must be integer token ids"),
], ids=["left-padding", "token-type-ids", "position-ids", "labels-on-padding", "no-input-ids", "not-a-tensor",
        "one-dim", "labels-shape", "labels-int32", "mask-values", "mask-float", "ids-float"])
def test_what_snake_would_train_differently_is_refused_by_name(tmp_path, batch, says):
    """Before anything is set up: the first batch is checked when the trainer's first run()
    reads it, and nothing is left in the offload_dir."""
    t = SnakeTrainer(make("llama"), data=[batch, batch], config=snake_config(tmp_path))
    with pytest.raises(DataError, match=None) as e:
        asyncio.run(t.run(1))
    assert says in str(e.value)
    asyncio.run(t.close())
    assert not list((tmp_path / "off").glob("*.bin"))


@pytest.mark.asyncio
async def test_a_dataloader_with_transformers_collator_trains(tmp_path):
    """The whole pipeline a Hugging Face user has: a tokenizer (a word-level one built here:
    no download), DataCollatorForLanguageModeling(mlm=False) in a torch DataLoader; the
    batches it gives train as their pairs do."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    words = "the a snake trains streams layers through memory disk fast slow model weights".split()
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")
    g = torch.Generator().manual_seed(0)
    texts = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (int(n),), generator=g))
             for n in torch.randint(6, 13, (12,), generator=g)]
    examples = [tokenizer(t) for t in texts]
    collate = DataCollatorForLanguageModeling(tokenizer, mlm=False, pad_to_multiple_of=12)
    loader = torch.utils.data.DataLoader(examples, batch_size=4, collate_fn=collate)
    batches = list(loader)
    assert set(batches[0]) == {"input_ids", "attention_mask", "labels"} and (batches[0]["labels"] == -100).any()

    async def train(given, directory):
        async with SnakeTrainer(make("llama"), data=given, config=snake_config(directory)) as t:
            await asyncio.wait_for(t.run(3), timeout=120)
            return await t.state_dict()

    got = await train(loader, tmp_path / "a")
    want = await train([pair_of(b) for b in batches], tmp_path / "b")
    for k, v in want.items():
        assert torch.equal(got[k], v), k
