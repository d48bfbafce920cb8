"""Image classification (ViT): what you change first is here.

- the data: image folders (<dir>/<class>/<image>) or files with image and label columns, read and checked in `build`;
- the model: a hub id or local directory (its image processor kept), or a preset, in `build`;
- the loss: the summed cross-entropy of shared/core/losses.py, or your own;
- the metrics: `compute_metrics`, over the whole validation set.
"""

from __future__ import annotations

import torch  # noqa: F401  (for a loss_fn or compute_metrics of your own below)

from ..core import data, datacheck, models
from ..core.errors import InputError
from ..core.tasks import Task, dataloaders, given_splits, limit
from . import images
from .images import load_raw_splits  # noqa: F401  (image folders; load_task reads it here)

# Your own loss: def loss_fn(logits, labels, kept) -> the batch's summed loss, which the loop divides by the
# global batch's items (`kept`: the columns load_task(keep_columns=) kept). None: the task's summed cross-entropy
# (shared/core/losses.py). chunked_loss and sequence_parallel, which compute the loss their own way, refuse
# one; the pipeline recipes train with it. docs/adapting_a_copy.md: class weights.
loss_fn = None


# Your own metrics: def compute_metrics(predictions, labels) -> {name: value}, over the whole validation set gathered
# from every process; each name is reported as eval_<name> (results.json, the trackers). None: eval_accuracy.
# docs/adapting_a_copy.md: F1.
compute_metrics = None


class ImageTask(Task):
    """Images: the image processor a pipeline needs beside the weights, and patches (+ [CLS]) as the tokens."""

    processor: object | None = None

    def tokens_in(self, batch: dict) -> int:
        cfg = vision_config(self.model.config)
        if not getattr(cfg, "patch_size", None):  # a CNN (ResNet, ConvNeXt) has no tokens: its throughput is images
            return batch["pixel_values"].shape[0]
        return batch["pixel_values"].shape[0] * ((batch["pixel_values"].shape[-1] // cfg.patch_size) ** 2 + 1)

    def save_preprocessing(self, output_dir: str) -> None:
        if self.processor is not None:
            self.processor.save_pretrained(output_dir)


def add_args(g) -> None:
    """The image task's flags (shared/core/args.py adds the chosen task's)."""
    g.add_argument("--train_dir", default=None, help="Image folder: one subfolder per class.")
    g.add_argument("--validation_dir", default=None)
    g.add_argument("--image_column", default=None)


def builtin_data(n: int, seed: int) -> dict[str, list]:
    """The built-in data (data.builtin_split): striped 32x32 images, resized to the model's size on the fly."""
    return images.pattern_images(n, seed, image_size=32)



def build(args, accelerator, train_raw, val_raw, source, batches: tuple[int, int], keep: tuple[str, ...] = ()
          ) -> Task:
    cols = [c for c in data.column_names(train_raw) if c != "classes"]
    image_col = data.pick_column(cols, args.image_column, images.IMAGE_GUESSES, "image", "image_column")
    label_col = data.pick_column(cols, args.label_column, data._LABEL_GUESSES, "label", "label_column")
    datacheck.check_roles({"image": image_col, "label": label_col})
    for split, ds in given_splits(train_raw, val_raw):
        datacheck.check_label_values(list(ds[label_col]), label_col, split)
    if args.train_dir or args.train_file:  # image paths (the built-in and hub images are decoded arrays)
        datacheck.check_held_out(train_raw, val_raw, [image_col])
    train_raw, val_raw = images.hold_out(train_raw, val_raw, source)
    train_raw, val_raw = limit(train_raw, args.max_train_samples), limit(val_raw, args.max_eval_samples)
    train_labels, val_labels = list(train_raw[label_col]), list(val_raw[label_col])
    tables = (args.train_file, args.validation_file or args.train_file)  # a held-out split is the train file's
    images.check_images(list(train_raw[image_col]), "training", tables[0])
    images.check_images(list(val_raw[image_col]), "validation", tables[1])
    classes, mapping = datacheck.label_set(train_labels, val_labels, label_col)
    folder_names = train_raw.get("classes") if isinstance(train_raw, dict) else None
    # a folder's class names, a hub dataset's ClassLabel names (its values are ids), or the label strings
    names = ([folder_names[int(c)] for c in classes] if folder_names
             else data.class_names(train_raw, label_col, classes) or (classes if mapping else None))
    to_id = datacheck.label_index(mapping)
    processor = None
    if args.model_name_or_path:
        extra = {"id2label": dict(enumerate(names))} if names else {}
        config = models.load_pretrained_config(args, num_labels=len(classes), **extra)
        processor = _pretrained_processor(args)
    else:
        config = models.preset_config(args.task, args.model_preset, num_labels=len(classes))
        if names:
            config.id2label = dict(enumerate(names))
    size = image_size(config, processor, models.model_source(args))
    channels = getattr(vision_config(config), "num_channels", 3)
    if channels != 3:  # every image is converted to RGB: 3 channels reach the model
        raise InputError(f"{models.model_source(args)!r} takes {channels}-channel images, and the images are read as "
                         "RGB (3 channels). Pass a model of 3 input channels, or change ImageDataset in "
                         "shared/tasks/images.py to read your channels.")
    # Saved beside the weights, so that pipeline("image-classification", model=output_dir) prepares an image as
    # training did: the same size, resampling and normalization.
    processor = processor or images.image_processor(size, [0.5] * 3, [0.5] * 3)
    mean, std = list(processor.image_mean), list(processor.image_std)
    if len(mean) != 3 or len(std) != 3:  # a grey model's processor: its normalization would not fit RGB images
        raise InputError(f"The image processor of {models.model_source(args)!r} normalizes {len(mean)} channel(s) "
                         f"(image_mean {mean}), and the images are read as RGB (3). Pass a model whose "
                         "preprocessor_config.json has 3 means and stds, or fix that file.")
    train_ds = images.ImageDataset(list(train_raw[image_col]), [to_id(v) for v in train_labels], size, mean, std)
    val_ds = images.ImageDataset(list(val_raw[image_col]), [to_id(v) for v in val_labels], size, mean, std)
    model = models.build_model(args, config)
    train_dl, eval_dl = dataloaders(args, accelerator, train_ds, val_ds, None, batches)
    task = ImageTask(args.task, model, models.model_source(args), train_dl, eval_dl, source,
                     stats={"train_examples": len(train_ds)}, loss_fn=loss_fn, compute_metrics=compute_metrics,
                     columns=({"folders": f"{args.train_dir}/<class>/", "classes": ", ".join(folder_names)}
                              if folder_names else {"image": image_col, "label": label_col}))
    task.processor = processor
    return task


def vision_config(config):
    """The config that describes the images: a vision tower's (CLIP, SigLIP: vision_config), else the model's."""
    return getattr(config, "vision_config", None) or config


def image_size(config, processor, source: str) -> int:
    """The side images are resized to: the config's (ViT; CLIP's vision tower), else the shipped processor's (a CNN
    such as ResNet or ConvNeXt names none in its config)."""
    side = getattr(vision_config(config), "image_size", None)
    side = side[0] if isinstance(side, list | tuple) else side
    if not side and processor is not None:
        shape = getattr(processor, "crop_size", None) or getattr(processor, "size", None) or {}
        # a dict in older processors, a SizeDict in transformers 5, or a bare int
        part = (lambda k: shape.get(k)) if isinstance(shape, dict) else (lambda k: getattr(shape, k, None))
        side = shape if isinstance(shape, int) else part("height") or part("shortest_edge")
    if not isinstance(side, int) or side < 1:
        raise InputError(f"{source!r} names no image size: its config has no image_size, and it ships no image "
                         "processor (preprocessor_config.json) that has one. Save the model's image processor beside "
                         "it (AutoImageProcessor.from_pretrained(<the model's hub id>).save_pretrained(dir)).")
    return side


def _pretrained_processor(args):
    """The pretrained model's own image processor (its normalization), when it ships one; one that does not load is
    refused (the loading boundary), not replaced by a default that normalizes differently."""
    from pathlib import Path

    from transformers import AutoImageProcessor

    from ..core.boundary import loading

    name = args.model_name_or_path
    if Path(name).is_dir() and not (Path(name) / "preprocessor_config.json").exists():
        return None  # none shipped: the preset's processing, saved beside the weights
    with loading("image processor", "--model_name_or_path", name):
        proc = AutoImageProcessor.from_pretrained(name)
    return proc if hasattr(proc, "image_mean") and hasattr(proc, "image_std") else None
