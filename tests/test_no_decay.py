"""Parameters without weight decay (`AdamW(no_decay=...)`): the weights of torch.optim.AdamW
with the two parameter groups, for every schedule, placement and delay ratio, for streamed
layers (cut at their parameters' boundaries) and the resident ones alike; bad filters
refused when the trainer is made."""


import pytest
import torch

from snake import AdamW, ConfigError, Placement, SnakeConfig, SnakeTrainer
from snake.optim import biases_and_norms, decay_flags
from tests.helpers import (
    assert_close_state,
    batches,
    norms_and_position_table,
    reference,
    schedule_alpha_placement,
    straight_and_resumed,
    tiny_gpt,
    train,
)

MIXED = Placement(param=0.5, ckpt=0.3, opt=0.6)
WD = 0.5  # large, so that a weight decayed or not differs by far more than the tolerance


@pytest.mark.asyncio
@pytest.mark.parametrize("schedule,alpha,placement", schedule_alpha_placement())
async def test_matches_torch_adamw_with_two_groups(tmp_path, schedule, alpha, placement):
    model = tiny_gpt(n_layer=3, bias=False)
    data = batches(3, 4)
    want, want_losses = reference(model, data, 2, wd=WD, no_decay=norms_and_position_table)
    got, report, _ = await train(model, data, 3, micro_batches=2, offload_dir=tmp_path, placement=placement,
                                 alpha=alpha, schedule=schedule,
                                 optimizer=AdamW(weight_decay=WD, no_decay=norms_and_position_table))
    assert_close_state(got, want)
    assert [s.loss for s in report.steps] == pytest.approx(want_losses, abs=1e-5)


@pytest.mark.asyncio
async def test_the_groups_change_the_weights(tmp_path):
    """The check above can fail: after one step exactly the weights without decay differ from
    a run that decays all (after more, every weight would)."""
    model = tiny_gpt(n_layer=2, bias=False)
    data = batches(1, 4)
    all_decay, _ = reference(model, data, 2, wd=WD)
    got, _, _ = await train(model, data, 1, micro_batches=2, offload_dir=tmp_path, alpha=0.3,
                            optimizer=AdamW(weight_decay=WD, no_decay=biases_and_norms))
    different = [k for k in got if not torch.allclose(got[k], all_decay[k], rtol=1e-5, atol=1e-6)]
    assert sorted(different) == sorted(k for k, v in got.items() if v.dim() < 2)  # the norms' weights


@pytest.mark.asyncio
async def test_a_parameter_without_a_gradient_and_without_decay(tmp_path):
    """Missed steps (a parameter no token reached) and the groups cut a layer at the same
    boundaries: the weights of torch, whose AdamW leaves such a parameter and counts its own
    steps."""
    from tests.test_parity import _routed_batches, _routed_parts, _RoutedLM

    torch.manual_seed(0)
    model = _RoutedLM()
    data = _routed_batches()
    want, _ = reference(model, data, 2, wd=WD, no_decay=biases_and_norms)
    got, _, _ = await train(_routed_parts(model), data, 5, micro_batches=2, offload_dir=tmp_path, placement=MIXED,
                            alpha=0.3, optimizer=AdamW(weight_decay=WD, no_decay=biases_and_norms))
    assert_close_state(got, want)


def test_flags_follow_the_names_per_layer_and_for_the_resident_parameters():
    from snake.adapters import describe

    parts = describe(tiny_gpt(n_layer=2, bias=False))
    seen: list[str] = []

    def no_decay(name: str, p: torch.Tensor) -> bool:
        seen.append(name)
        return name.startswith("blocks.1.ln") or name == "ln_f.weight"

    layers, res = decay_flags(parts, AdamW(weight_decay=WD, no_decay=no_decay))
    assert layers[0] is None  # every parameter of layer 0 takes decay
    names = [n for n, _ in parts.model.blocks[1].named_parameters()]
    assert layers[1] == [not n.startswith("ln") for n in names]
    assert "blocks.1.attn.c_attn.weight" in seen and "wte.weight" in seen and "lm_head.weight" not in seen  # tied: once
    assert res == [n != "ln_f.weight" for n, _ in parts.model.named_parameters() if not n.startswith("blocks.")]


@pytest.mark.parametrize("no_decay,says", [
    (lambda n, p: 1 / 0, "optimizer.no_decay='<lambda>' raised ZeroDivisionError: division by zero for 'blocks.0.ln_1.weight'"),
    (lambda n, p: "yes", "optimizer.no_decay='<lambda>' gave 'yes' for 'blocks.0.ln_1.weight'"),
])
def test_a_filter_that_fails_is_refused_when_the_trainer_is_made(tmp_path, no_decay, says):
    cfg = SnakeConfig(offload_dir=tmp_path / "off", optimizer=AdamW(no_decay=no_decay))
    with pytest.raises(ConfigError) as err:
        SnakeTrainer(tiny_gpt(n_layer=1), data=batches(1, 2), config=cfg)
    assert str(err.value).startswith(says)
    assert not (tmp_path / "off").exists()  # refused before the offload_dir was made


def test_a_filter_that_is_not_callable_is_refused():
    with pytest.raises(ConfigError, match=r"optimizer\.no_decay"):
        AdamW(no_decay=["bias"])


@pytest.mark.asyncio
async def test_resuming_keeps_the_groups_bitwise(tmp_path):
    straight, resumed, _, manifest = await straight_and_resumed(
        tmp_path, tiny_gpt(n_layer=2, bias=False), batches(4, 4), 2, 2, micro_batches=2, placement=MIXED, alpha=0.3,
        optimizer=AdamW(weight_decay=WD, no_decay=biases_and_norms))
    for k in straight:
        assert torch.equal(resumed[k], straight[k]), k
    assert manifest["config"]["optimizer"]["no_decay"] == {"kind": "callable", "name": "biases_and_norms"}
