"""The recipes: the option groups, the optimizer's groups, the schedules, the keyed batch draws,
and two short real runs (EMA validated beside the weights; a frozen backbone)."""

import json

import pytest
import torch
import torchvision
from helpers.runs import train_argv

from kfvision.trainer.config import TrainConfig, config_from_args, get_args_parser
from kfvision.trainer.presets import RECIPES
from kfvision.trainer.recipes import BatchAugment, keyed_draws, lr_factor, param_groups


def _cfg(*flags):
    args = get_args_parser().parse_args(["--model", "m", "--train", "t", "--val", "v",
                                         "--out", "o", *flags])
    return config_from_args(args).resolved()


def test_azure_is_the_default_and_todays_behaviour():
    cfg = _cfg()
    assert (cfg.recipe, cfg.optimizer, cfg.lr_schedule, cfg.augment) == ("azure", "sgd", "poly",
                                                                         "standard")
    assert cfg.label_smoothing == cfg.mixup_alpha == cfg.ema_decay == 0
    assert cfg.norm_weight_decay is None and cfg.lr == 0.001 and cfg.weight_decay == 1e-4


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_recipe_sets_its_group_and_an_option_given_by_hand_wins(recipe):
    cfg = _cfg("--recipe", recipe)
    assert all(getattr(cfg, k) == v for k, v in RECIPES[recipe].items())
    cfg = _cfg("--recipe", recipe, "--optimizer", "adamw", "--label-smoothing", "0",
               "--augment", "light")
    assert (cfg.optimizer, cfg.label_smoothing, cfg.augment) == ("adamw", 0.0, "light")


def test_a_recipe_option_out_of_range_is_refused_by_flag():
    from kfvision.trainer.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="--freeze-backbone-epochs = 9"):
        TrainConfig("m", "t", "v", "o", epochs=3, freeze_backbone_epochs=9).validate()


def test_norms_and_biases_get_their_own_weight_decay_and_the_head_its_group():
    model = torchvision.models.resnet18(num_classes=3)
    groups = param_groups(model, 1e-4, 0.0, frozenset({"fc.weight", "fc.bias"}))
    by = {(g["is_head"], g["weight_decay"]): sum(p.numel() for p in g["params"]) for g in groups}
    bn = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)
             for p in m.parameters())
    assert by[(False, 0.0)] == bn and by[(True, 0.0)] == 3 and by[(True, 1e-4)] == 3 * 512
    assert sum(by.values()) == sum(p.numel() for p in model.parameters())
    assert all(g["weight_decay"] == 1e-4 for g in param_groups(model, 1e-4, None))


def test_cosine_and_poly_schedules_after_warm_up():
    assert lr_factor(0, 2, 10, 1.0, "cosine") == 0.5 and lr_factor(1, 2, 10, 1.0, "cosine") == 1
    assert lr_factor(2, 2, 10, 1.0, "cosine") == 1.0 and lr_factor(6, 2, 10, 1.0, "cosine") == (
        pytest.approx(0.5))
    assert lr_factor(10, 2, 10, 1.0, "cosine") == pytest.approx(0.0)
    assert lr_factor(6, 2, 10, 1.0, "poly") == pytest.approx(0.5)


def test_batch_draws_are_keyed_by_seed_epoch_step_and_rank_not_by_what_ran_before():
    aug = BatchAugment("strong", 0.2, 1.0, num_classes=4)
    images = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    labels = torch.tensor([0, 1, 2, 3, 0, 1])

    def draw(seed, epoch, step, rank):
        with keyed_draws(seed, epoch, step, rank):
            x = aug.pixels(images).float()
            return aug.normalised(x, labels)

    a = draw(1, 2, 3, 0)
    torch.rand(100)  # other draws in between change nothing
    b = draw(1, 2, 3, 0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[1].shape == (6, 4) and torch.allclose(a[1].sum(1), torch.ones(6))
    assert not torch.equal(draw(1, 2, 4, 0)[0], a[0])
    assert not torch.equal(draw(1, 2, 3, 1)[0], a[0])


@pytest.mark.slow
def test_ema_is_validated_beside_the_weights_and_a_frozen_backbone_stays_put(micro_digits,
                                                                            resnet18_dir,
                                                                            tmp_path):
    """One real epoch with the torchvision recipe (mixup/cutmix, strong augmentation, EMA),
    the backbone frozen: metrics.json says which weights won; the backbone is the initial one."""
    from kfvision.trainer.model.arch import build_model
    from kfvision.trainer.model.spec import read_model_spec
    from kfvision.trainer.model.trained import load_trained_model
    from kfvision.trainer.rng import seed_everything
    from kfvision.trainer.train import main

    assert main(train_argv(resnet18_dir, micro_digits, tmp_path / "out", epochs=1,
                           image_size=32, batch_size=8, lr=0.05, recipe="torchvision",
                           ema_decay=0.5, freeze_backbone_epochs=1, print_freq=100,
                           workers=0, conv_gemm="off")) == 0
    history = json.loads((tmp_path / "out" / "metrics.json").read_text())["history"]
    assert history[0]["weights"] in ("ema", "model") and "val_loss_ema" in history[0]
    chosen = history[0]["val_loss_" + history[0]["weights"]]
    assert history[0]["val_loss"] == chosen == min(history[0]["val_loss_ema"],
                                                   history[0]["val_loss_model"])
    config = json.loads(json.dumps(
        __import__("yaml").safe_load((tmp_path / "out" / "config.yaml").read_text())))
    assert config["optimizer"] == "sgd" and config["augment"] == "strong"
    trained, _ = load_trained_model(tmp_path / "out")
    seed_everything(1)
    initial = build_model(read_model_spec(resnet18_dir), 10, resnet18_dir, image_size=32)
    assert torch.equal(trained.conv1.weight, initial.conv1.weight)
    assert torch.equal(trained.layer1[0].conv1.weight, initial.layer1[0].conv1.weight)
    assert not torch.equal(trained.fc.weight, initial.fc.weight)
