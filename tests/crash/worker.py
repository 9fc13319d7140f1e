"""A training process for the crash tests: resumes from `ckpt` if there is one, trains to
`steps` saving a checkpoint after every step, then writes the final weights to `out`.
Run as `python -m tests.crash.worker OFFLOAD CKPT STEPS OUT`."""

import asyncio
import os
import sys
from pathlib import Path

from safetensors.torch import save_file

from snake import Placement, SnakeConfig, SnakeTrainer
from tests.helpers import batches, tiny_gpt


async def main(offload: str, ckpt: str, steps: int, out: str) -> None:
    # one batch to spare: a trainer that resumes after the last step still sizes its buffers
    # from the next batch
    data = batches(steps + 1, 4)
    cfg = SnakeConfig(
        micro_batches=2, offload_dir=offload, placement=Placement(param=0.5, ckpt=0.5, opt=0.5),
        alpha=0.3, device="cpu",
    )
    resume = (Path(ckpt) / "manifest.json").exists()
    # a fresh run starts from seed 0; a resumed one from another init it must owe nothing to
    model = tiny_gpt(n_layer=3, bias=False, dropout=0.1, seed=os.getpid() if resume else 0)
    async with SnakeTrainer(model, data=data, config=cfg) as trainer:
        done = 0
        if resume:
            await trainer.load(ckpt)
            done = trainer.engine.next_t
            print(f"resumed at {done}", flush=True)
        for _ in range(done, steps):
            await trainer.run(1)
            await trainer.save(ckpt)
            print(f"saved {trainer.engine.next_t}", flush=True)
        state = await trainer.state_dict()
    tmp = out + ".tmp"
    save_file({k: v.contiguous() for k, v in state.items()}, tmp)
    os.replace(tmp, out)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
