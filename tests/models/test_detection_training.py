"""torchvision detection models in training mode, wrapped vs eager: images and target
dicts in, the loss dict out, then ``backward``. The broad tier checks these models in
eval only (their training forward needs targets); here each one runs three training
calls with fresh random images and boxes (masks and keypoints where the model has those
heads), and every loss and every parameter gradient is compared with eager's.

Detection training draws random numbers (the RPN and the ROI heads sample anchors and
proposals, ``torch.randperm``): the global seed is set to the same value before each
side's call, so both sample the same ones.

The root forward cannot be traced (it checks its targets' types and loops over
images), so every call runs under eager dispatch; what is scheduled are the nested
plans of its children (``streamsched.nesting``): the backbone with its FPN, the heads.
``executor="serial"`` names the executor, so no trial runs a child as written: on the
first call each child records, on the next ones it runs its plan, and both are asserted
child by child. The RPN itself runs as written (it takes an ``ImageList`` object, which
a trace would bake in).

Values: a call of children whose plans fused nothing runs eager's kernels in eager's
order and must be bitwise equal; with fused groups (the two Linears of the box
predictor, the ResNet backbones' parallel convolutions) the rules of ``checks.py``
apply: float32 tolerances, the distance from a float64 eager run, and where those fail
(a fused rounding that moves a proposal through a near tie in top-k or NMS changes
which proposals are sampled, and with them the losses) the float64 wrapper decides. A
float64 copy of the model, wrapped with the same options, runs every call in lockstep
with float64 eager, and its losses and gradients must agree with eager's to 1e-9 of
their norm on every call.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
from torch import nn

torchvision = pytest.importorskip("torchvision")
pytest.importorskip("timm")  # the models tier's environment (.venv-cuda)

import streamsched as ss  # noqa: E402
from streamsched.testing import last_path  # noqa: E402

from .broad import derandomize  # noqa: E402
from .checks import FUSED64_RTOL, PATHS_SEEN, _nested_fused, compare_tensor, double_copy, report  # noqa: E402

detection = torchvision.models.detection
CALLS = 3
MIN_COVERAGE = 0.8


@dataclass
class Case:
    build: Callable[[], nn.Module]
    num_classes: int
    # Nested children (module paths) that must run their plans on every call after the first.
    planned: tuple[str, ...]
    # Nested children that run under eager dispatch (untraceable, their own children nested).
    dispatched: tuple[str, ...] = ()
    masks: bool = False
    keypoints: int = 0
    image_sizes: tuple = ((96, 112), (104, 96))
    min_coverage: float = MIN_COVERAGE


# The R-CNN models sample box_batch_size_per_image proposals per image (default 512), a
# quarter of them positive at most: on 100-pixel images fewer proposals than that survive
# NMS and their number changes every call, so the box head would see a new shape (and
# record again) on every call; the mask and keypoint heads see the positives only. 8 per
# image, 2 of them positive (the ground-truth boxes are proposals too, so there always
# are 2), keeps both batches the same size from call to call.
_RCNN = dict(min_size=96, max_size=128, box_batch_size_per_image=8)
# The RPN takes an ``ImageList`` object and runs as written; its head (a 3x3 convolution
# and two 1x1 ones on every FPN level) is passed a list of tensors and nested below it.
_RCNN_HEADS = ("rpn.head", "roi_heads.box_head", "roi_heads.box_predictor")


def _resnet18_fpn() -> nn.Module:
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    return resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5)


def _maskrcnn() -> nn.Module:
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor
    from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor

    return detection.MaskRCNN(
        _resnet18_fpn(),
        box_predictor=FastRCNNPredictor(1024, 5),
        mask_head=MaskRCNNHeads(256, [64, 64], 1),
        mask_predictor=MaskRCNNPredictor(64, 64, 5),
        **_RCNN,
    )


def _keypointrcnn() -> nn.Module:
    from torchvision.models.detection.keypoint_rcnn import KeypointRCNNHeads, KeypointRCNNPredictor

    heads, predictor = KeypointRCNNHeads(256, [64, 64]), KeypointRCNNPredictor(64, 5)
    return detection.KeypointRCNN(
        _resnet18_fpn(), num_classes=2, keypoint_head=heads, keypoint_predictor=predictor, **_RCNN
    )


CASES: dict[str, Case] = {
    "fasterrcnn_mobilenet_v3_large_320_fpn": Case(
        lambda: detection.fasterrcnn_mobilenet_v3_large_320_fpn(
            weights=None, weights_backbone=None, num_classes=5, **_RCNN
        ),
        num_classes=5,
        planned=("backbone", *_RCNN_HEADS),
        dispatched=("roi_heads",),
    ),
    "retinanet_resnet50_fpn": Case(
        lambda: detection.retinanet_resnet50_fpn(
            weights=None, weights_backbone=None, num_classes=5, min_size=96, max_size=128
        ),
        num_classes=5,
        planned=("backbone", "head"),
    ),
    "ssdlite320_mobilenet_v3_large": Case(
        lambda: detection.ssdlite320_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=5),
        num_classes=5,
        planned=("backbone", "head"),
    ),
    "fcos_resnet50_fpn": Case(
        lambda: detection.fcos_resnet50_fpn(
            weights=None, weights_backbone=None, num_classes=5, min_size=96, max_size=128
        ),
        num_classes=5,
        planned=("backbone", "head"),
    ),
    # Mask and Keypoint R-CNN on a ResNet-18 FPN, their mask and keypoint heads two 64-channel
    # convolutions instead of four or eight of 256 and 512 (the ResNet-50 models take 5-8 s
    # a call here, the keypoint head most of it).
    "maskrcnn_resnet18_fpn": Case(
        _maskrcnn,
        num_classes=5,
        planned=("backbone", *_RCNN_HEADS, "roi_heads.mask_head", "roi_heads.mask_predictor"),
        dispatched=("roi_heads",),
        masks=True,
    ),
    "keypointrcnn_resnet18_fpn": Case(
        _keypointrcnn,
        num_classes=2,
        # The keypoint predictor is one ConvTranspose2d: a leaf, not nested.
        planned=("backbone", *_RCNN_HEADS, "roi_heads.keypoint_head"),
        dispatched=("roi_heads",),
        keypoints=5,
    ),
}


def make_inputs(case: Case, g: torch.Generator) -> tuple[list[torch.Tensor], list[dict]]:
    """Fresh random images and, per image, three boxes with labels (and masks filling
    the boxes, keypoints inside them)."""
    images, targets = [], []
    for h, w in case.image_sizes:
        images.append(torch.rand(3, h, w, generator=g))
        xy = torch.rand(3, 2, generator=g) * torch.tensor([w * 0.6, h * 0.6])
        wh = 8 + torch.rand(3, 2, generator=g) * 24
        boxes = torch.cat([xy, xy + wh], 1)
        target = {"boxes": boxes, "labels": torch.randint(1, case.num_classes, (3,), generator=g)}
        if case.masks:
            masks = torch.zeros(3, h, w, dtype=torch.uint8)
            for j, b in enumerate(boxes.long().tolist()):
                masks[j, b[1] : b[3], b[0] : b[2]] = 1
            target["masks"] = masks
        if case.keypoints:
            xy_k = boxes[:, None, :2] + torch.rand(3, case.keypoints, 2, generator=g) * wh[:, None]
            target["keypoints"] = torch.cat([xy_k, torch.ones(3, case.keypoints, 1)], 2)
        targets.append(target)
    return images, targets


def _double(images: list, targets: list) -> tuple[list, list]:
    """The float64 run's inputs: torchvision takes keypoint targets in float32 only."""
    cast = lambda k, t: t.double() if t.is_floating_point() and k != "keypoints" else t  # noqa: E731
    return [i.double() for i in images], [{k: cast(k, v) for k, v in t.items()} for t in targets]


def step(call: Callable, model: nn.Module, images: list, targets: list, seed: int) -> tuple[dict, dict]:
    """One training step from zero gradients: the loss dict and every parameter's grad."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    losses = call([i.clone() for i in images], copy.deepcopy(targets))
    sum(losses.values()).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach() for k, v in losses.items()}, grads


def nested_paths(sm: ss.StreamScheduledModule, prefix: str = "") -> dict[str, str]:
    """The path (``last_path``) of every nested child's most recent call, by module path."""
    out: dict[str, str] = {}
    nested = sm._ss.nested
    if nested is None:
        return out
    for site in nested._known.values():
        if site.wrapper is None:
            continue
        path = prefix + site.path
        out[path] = last_path(site.wrapper)
        out.update(nested_paths(site.wrapper, path + "."))
    return out


def _check_paths(sm: ss.StreamScheduledModule, case: Case, call: int, what: str) -> dict[str, str]:
    assert last_path(sm) == "eager-dispatch", f"{what}: the root ran {last_path(sm)!r}"
    paths = nested_paths(sm)
    want = "recorded" if call == 0 else "plan:serial"
    wrong = {p: paths.get(p) for p in case.planned if paths.get(p) != want}
    wrong.update({p: paths.get(p) for p in case.dispatched if paths.get(p) != "eager-dispatch"})
    assert not wrong, f"{what}: nested children expected {want!r} ran {wrong} (all: {paths})"
    return paths


def _keys(what: str, actual: dict, expected: dict) -> str:
    wrapper_only, eager_only = sorted(set(actual) - set(expected)), sorted(set(expected) - set(actual))
    return f"{what}: only the wrapper's {wrapper_only}, only eager's {eager_only}"


def _compare(what: str, actual: dict, expected: dict, fused: bool, exp64: dict, act64: dict) -> list[str]:
    problems = []
    if set(actual) != set(expected):
        return [_keys(what, actual, expected)]
    for k in expected:
        problem = compare_tensor(
            f"{what} {k}",
            actual[k],
            expected[k],
            fused,
            reference64=lambda k=k: exp64[k],
            wrapped64=lambda k=k: (act64[k], exp64[k]),
        )
        if problem:
            problems.append(problem)
    return problems


def _compare64(what: str, actual: dict, expected: dict) -> list[str]:
    """The float64 wrapper against float64 eager: within 1e-9 of the value's norm, or of
    1e-4 of the norm of all of them together (the gradient of a bias that BatchNorm
    cancels is zero but for rounding, 1e-16, and its reordered sums differ by as much)."""
    if set(actual) != set(expected):
        return [_keys(what, actual, expected)]
    problems = []
    scale = float(torch.stack([e.norm() for e in expected.values()]).norm())
    for k, e in expected.items():
        d, norm = float((actual[k] - e).norm()), float(e.norm())
        if d > FUSED64_RTOL * max(norm, 1e-4 * scale, 1e-300):
            problems.append(f"{what} {k}: {d:.3g} from eager (norm {norm:.3g})")
    return problems


@pytest.mark.parametrize("name", sorted(CASES))
def test_detection_training_losses_and_grads(name):
    case = CASES[name]
    torch.manual_seed(0)
    model = derandomize(case.build()).train()
    eager = copy.deepcopy(model)
    model64, eager64 = double_copy(model).train(), double_copy(model).train()
    sm = ss.StreamScheduledModule(model, executor="serial")
    sm64 = ss.StreamScheduledModule(model64, executor="serial")
    seen: Counter[Any] = PATHS_SEEN.setdefault((f"det_train_{name}", "serial"), Counter())
    g = torch.Generator().manual_seed(1)
    for call in range(CALLS):
        what = f"{name} training call {call}"
        images, targets = make_inputs(case, g)
        images64, targets64 = _double(images, targets)
        # The same state before every side's call (BatchNorm statistics move each call).
        state = eager.state_dict()
        model.load_state_dict(state)
        model64.load_state_dict(state)
        eager64.load_state_dict(state)
        seed = 100 + call
        exp_losses, exp_grads = step(eager, eager, images, targets, seed)
        losses, grads = step(sm, model, images, targets, seed)
        paths = _check_paths(sm, case, call, what)
        seen[last_path(sm)] += 1
        seen.update(f"nested {p}" if not p.startswith("plan:") else p for p in paths.values())
        exp64_losses, exp64_grads = step(eager64, eager64, images64, targets64, seed)
        losses64, grads64 = step(sm64, model64, images64, targets64, seed)
        _check_paths(sm64, case, call, what + " (float64)")
        fused = call > 0 and _nested_fused(sm)
        problems = _compare64("float64 loss", losses64, exp64_losses)
        problems += _compare64("float64 grad", grads64, exp64_grads)
        problems += _compare("loss", losses, exp_losses, fused, exp64_losses, losses64)
        problems += _compare("grad", grads, exp_grads, fused, exp64_grads, grads64)
        report(problems, f"{what} (nested paths {paths}, fused: {fused})")
    coverage = sm.plan.coverage
    print(f"{name}: {sm.plan.coverage_text()}")
    assert coverage >= case.min_coverage, (
        f"{name}: coverage {coverage:.2f} ({sm.plan.mode}, nested {sorted(sm.nested_plans)})"
    )
